"""The operator's side of the ``weightcache`` command against a real daemon: ``--version``,
``--json``, ``load`` (the Preload RPC with a progress bar), Hub repo ids from the local
Hub cache, ``ls``'s progress column."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from google.protobuf import json_format

from tests.race_support import pause_step
from tests.recipe_support import children_env, write_hub_repo
from tests.support import (
    Checkpoints,
    DaemonPool,
    child_env,
    cli_command,
    get_model,
    run_cli,
    service_stub,
    wait_until,
)
from weightcache.core.version import __version__
from weightcache.testing.daemon import list_models
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache_service.admin import EXIT_INTERRUPTED
from weightcache_service.admin import progress as _progress

REPO_ID = "acme/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LOADING, READY = pb.MODEL_STATE_LOADING, pb.MODEL_STATE_READY


def _cli_env(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*cli_command(), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(env),
        check=False,
    )


@pytest.fixture
def hub_env(checkpoints: Checkpoints, tmp_path: Path) -> dict[str, str]:
    """A Hub cache holding ``single`` as ``acme/tiny`` at :data:`COMMIT` (``main``)."""
    write_hub_repo(tmp_path / "hub", REPO_ID, checkpoints.single, COMMIT)
    return {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}


def test_version() -> None:
    result = run_cli("--version")

    assert (result.returncode, result.stdout, result.stderr) == (
        0,
        f"weightcache {__version__}\n",
        "",
    )


def test_ls_and_info_as_json(daemons: DaemonPool, checkpoints: Checkpoints) -> None:
    daemon = daemons.start([checkpoints.single])

    ls = run_cli("ls", "--json", "--socket", daemon.socket)
    info = run_cli("info", "--json", "--socket", daemon.socket)

    assert (ls.returncode, ls.stderr, info.returncode, info.stderr) == (0, "", 0, "")
    with service_stub(daemon.socket) as stub:
        server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    listed = json_format.ParseDict(json.loads(ls.stdout), pb.ListModelsResponse())
    assert list(listed.models) == list_models(daemon.socket)
    shown = json_format.ParseDict(json.loads(info.stdout), pb.GetServerInfoResponse())
    assert shown == server
    [model] = json.loads(ls.stdout)["models"]
    assert (model["name"], model["state"]) == ("single", "MODEL_STATE_READY")


def test_load_follows_the_preload_until_ready(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    root = checkpoints.sharded.parent
    daemon = daemons.start(args=["--allow-remote-preload", "--model-root", str(root)])

    result = run_cli("load", str(checkpoints.sharded), "--socket", daemon.socket)

    model = get_model(daemon.socket, "sharded")
    assert model.state == pb.MODEL_STATE_READY
    assert (result.returncode, result.stdout) == (
        0,
        f"sharded READY {model.progress.bytes_total} bytes\n",
    )
    assert "sharded" in result.stderr  # the progress bar, on stderr


def test_load_refused_names_the_reason(daemons: DaemonPool, checkpoints: Checkpoints) -> None:
    daemon = daemons.start()

    result = run_cli("load", str(checkpoints.single), "--socket", daemon.socket)

    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (
        "weightcache load: PERMISSION_DENIED: remote Preload is disabled; start the daemon "
        "with --allow-remote-preload and --model-root\n"
    )
    assert list_models(daemon.socket) == []


def test_preload_and_load_take_a_hub_repo_id(
    daemons: DaemonPool, hub_env: dict[str, str], tmp_path: Path
) -> None:
    snapshot = str(tmp_path / "hub" / "models--acme--tiny" / "snapshots" / COMMIT)
    daemon = daemons.start([REPO_ID], env=hub_env)
    [model] = list_models(daemon.socket)
    assert (model.path, model.state) == (str(Path(snapshot).resolve()), pb.MODEL_STATE_READY)

    other = daemons.start(
        args=["--allow-remote-preload", "--model-root", str(tmp_path / "hub")], env=hub_env
    )
    result = _cli_env("load", REPO_ID, "--revision", COMMIT, "--socket", other.socket, env=hub_env)
    assert result.returncode == 0, result.stderr
    [loaded] = list_models(other.socket)
    assert (loaded.path, loaded.fingerprint) == (model.path, model.fingerprint)


def test_unknown_repo_id_is_refused_and_keeps_the_daemon_unready(
    daemons: DaemonPool, hub_env: dict[str, str]
) -> None:
    daemon = daemons.start(["acme/absent"], env=hub_env)  # the start-up ends

    ready = run_cli("health", "--socket", daemon.socket)

    why = (
        "acme/absent: no such file or folder, nor a Hub repo with revision main in the local "
        "Hub cache (download it first, e.g. `hf download`)"
    )
    [model] = list_models(daemon.socket)
    assert (model.name, model.path, model.state) == (
        "absent",
        "acme/absent",
        pb.MODEL_STATE_FAILED,
    )
    assert (ready.returncode, ready.stdout) == (1, f"NOT_SERVING\nabsent FAILED: {model.error}\n")
    assert why in daemon.log()


def test_ls_progress_column() -> None:
    def model(state: int, done: int, total: int) -> pb.Model:
        return pb.Model(state=state, progress=pb.LoadProgress(bytes_done=done, bytes_total=total))  # type: ignore[arg-type]

    assert _progress(model(pb.MODEL_STATE_LOADING, 256, 1024)) == "25%"
    assert _progress(model(pb.MODEL_STATE_LOADING, 0, 0)) == "0%"
    assert _progress(model(pb.MODEL_STATE_READY, 1024, 1024)) == "-"
    assert _progress(model(pb.MODEL_STATE_LOADING, 1024, 1024)) == "hashing"  # no digest yet


def test_log_level_filters_the_daemons_lines(daemons: DaemonPool, checkpoints: Checkpoints) -> None:
    quiet = daemons.start([checkpoints.single], args=["--log-level", "warning"])
    chatty = daemons.start([checkpoints.single], args=["--log-level", "info"])

    assert "listening" not in quiet.log()
    assert "listening" in chatty.log()
    assert [m.state for m in list_models(quiet.socket)] == [pb.MODEL_STATE_READY]


def test_every_option_of_every_subcommand_has_help() -> None:
    import argparse

    from weightcache_service.cli import _parser

    [sub] = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [
        f"{command} {action.option_strings[0]}"
        for command, parser in sub.choices.items()
        for action in parser._actions
        if action.option_strings and not action.help
    ]
    shown = _cli_env("preload", "--help", env={"COLUMNS": "1000"})

    assert missing == []
    assert shown.returncode == 0
    assert (
        "  --fingerprint-level {layout,sampled,full}\n"
        "                        how much content the identity covers: full (sha256 of every "
        "byte), sampled, layout; workers must load at the same level (default full)\n"
    ) in shown.stdout
    assert (
        "  --log-format {console,json}\n"
        "                        log lines on stderr: console (aligned text) or json (one "
        "object a line)\n"
    ) in shown.stdout


def test_ctrl_c_on_load_says_the_daemon_goes_on(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """SIGINT while ``weightcache load`` follows a load: no traceback, exit 130, a line
    saying the daemon goes on, which it does (the model turns READY). The load is held
    LOADING by the ``pause`` plugin until the signal has been handled, whatever the
    machine's load (issue 35: a large checkpoint alone could finish first)."""
    root, pause = tmp_path / "root", tmp_path / "pause"
    shutil.copytree(checkpoints.single, root / "model")
    pause.mkdir()
    env = children_env(tmp_path / "hash-cache")
    allow = ["--allow-remote-preload", "--model-root", str(root), "--allow-recipe", "pause"]
    daemon = daemons.start(args=allow, env=env)
    command = [*cli_command(), "load", str(root / "model"), "--socket", daemon.socket]
    command += ["--recipe", pause_step(pause)]
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=child_env(env)) as load:
        wait_until((pause / "reached").exists, 120)
        assert [m.state for m in list_models(daemon.socket)] == [LOADING]
        load.send_signal(signal.SIGINT)
        _, stderr = load.communicate(timeout=60)
    (pause / "go").touch()

    assert load.returncode == EXIT_INTERRUPTED
    assert "Traceback" not in stderr
    assert stderr.endswith(
        "weightcache load: interrupted; the daemon goes on loading the model (`weightcache ls` "
        "shows its progress, `weightcache evict NAME` drops it once loaded)\n"
    )
    wait_until(lambda: [m.state for m in list_models(daemon.socket)] == [READY], 120)
