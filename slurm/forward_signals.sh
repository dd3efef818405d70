# Sourced by ray_cluster.sh. run_forwarding_signals COMMAND [ARGS...] runs the command in the background,
# forwards SIGUSR1 and SIGTERM sent to this shell to it, and returns once it has exited, with
#   status     the command's own exit status (never that of a `wait` a trapped signal interrupted), and
#   signalled  the last signal forwarded (USR1 or TERM), empty when none was.
# A trapped signal makes `wait` return 128+N at once, and the command may exit before the next check:
# so it waits until the command is gone, then once more for its status (bash keeps it for that).

forward() {
    signalled="$1"
    echo "[ray_cluster] SIG$1 received; forwarding it to the command"
    kill -s "$1" "$child" 2>/dev/null || true
}

run_forwarding_signals() {
    signalled=""
    "$@" &
    child=$!
    trap 'forward USR1' USR1
    trap 'forward TERM' TERM
    while kill -0 "$child" 2>/dev/null; do
        wait "$child" || true
    done
    trap - USR1 TERM
    status=0
    wait "$child" || status=$?
}
