# Liveness of the inference container under restart.strategy container (POSIX sh, awk, sed).
# Fails only on a verdict the watchdog wrote after this container started, within its time to
# live: no file, an unreadable or garbled one, one older than the container, or one the kubelet
# should long have acted on all pass. A sidecar that is down never gets this container killed.
f="${GPU_WATCHDOG_VERDICT_FILE:-/var/run/gpu-watchdog-verdict/restart}"
pid="${GPU_WATCHDOG_VERDICT_PID:-1}"
ttl="${GPU_WATCHDOG_VERDICT_TTL:-300}"
[ -r "$f" ] || exit 0
read -r at reason < "$f" || exit 0
case "$at" in ''|*[!0-9]*) exit 0 ;; esac
btime=$(awk '$1 == "btime" {print $2}' /proc/stat 2>/dev/null)
# Field 22 of /proc/PID/stat, counted after the parenthesised command name: start in clock ticks
# since boot (USER_HZ, 100 on Linux).
ticks=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | awk '{print $20}')
case "$btime$ticks" in ''|*[!0-9]*) exit 0 ;; esac
start=$((btime + ticks / 100))
now=$(date +%s)
# btime and the verdict are whole seconds, so the start read here may lie up to a second early: a
# verdict must postdate it by more than 2 s to count. A container is never that young when the
# watchdog decides against it (that takes failed canaries over several seconds), and a new one the
# kubelet starts right after a verdict must not be killed by it.
[ "$at" -gt $((start + 2)) ] || exit 0
[ $((now - at)) -lt "$ttl" ] || exit 0
echo "gpu-watchdog: restart this container in place (${reason:-unknown})"
exit 1
