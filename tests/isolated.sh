#!/bin/sh
# Run a command (the test suite) in a mount namespace of its own whose /dev/shm is a fresh
# tmpfs of the same size, when root can make one (unshare(1)); elsewhere run it as it is.
#
# Why: every daemon that starts removes the segments of dead daemons of its user anywhere
# in /dev/shm (weightcache_service.segments.remove_dead_segments), which is what a host
# wants. Two suites on one machine (two clones, CI beside a developer) would then remove
# each other's dead segments, and a test that kills a daemon and checks that its successor
# removes what it left could see another suite's daemon do it first. Every process the
# suite starts (daemons, workers, `ip netns exec`, `unshare`) inherits the namespace.
# The suite's own leftover checks (weightcache.testing) still run inside it.
set -eu
if [ "$(id -u)" = 0 ] && [ -z "${WEIGHTCACHE_TEST_ISOLATED:-}" ] \
    && unshare --mount --propagation private true 2>/dev/null; then
    size="$(df --output=size -k /dev/shm | tail -n 1 | tr -d ' ')k"
    export WEIGHTCACHE_TEST_ISOLATED=1
    exec unshare --mount --propagation private -- sh -c \
        'mount -t tmpfs -o "mode=1777,size=$0" tmpfs /dev/shm && exec "$@"' "$size" "$@"
fi
exec "$@"
