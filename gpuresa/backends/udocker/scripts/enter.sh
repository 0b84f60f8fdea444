#!/bin/sh
# sshd's ForceCommand for a gpuresa udocker session: run by the user's own
# sshd, as the user, on the host. Enters the session's container (its user,
# mount, PID, IPC and UTS namespaces: the user owns them) and runs the login
# shell, the command or the SFTP server there. Given: the session's folder.
set -eu
folder="$1"
files="$2"
if [ -f "$files/nologin" ]; then
    cat "$files/nologin" >&2
    exit 1
fi
pid=$(cat "$folder/container.pid")
enter() {
    exec nsenter --target "$pid" --user --mount --pid --ipc --uts --preserve-credentials -- \
        /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" LANG="${LANG:-C.UTF-8}" \
        USER="$LOGNAME" LOGNAME="$LOGNAME" SHELL=/bin/bash "$@"
}
# the login's lasting home where the session has one (gpuresa's homes), else root's
home="/home/$LOGNAME"
case "${SSH_ORIGINAL_COMMAND:-}" in
'')
    cat "$files/motd" 2>/dev/null || true
    enter "GPURESA_HOME=$home" /bin/sh -c '[ -d "$GPURESA_HOME" ] || GPURESA_HOME=/root; export HOME="$GPURESA_HOME"; unset GPURESA_HOME; cd "$HOME" && exec /bin/bash -l'
    ;;
/usr/lib/openssh/sftp-server | internal-sftp)
    enter "GPURESA_HOME=$home" /bin/sh -c '[ -d "$GPURESA_HOME" ] || GPURESA_HOME=/root; export HOME="$GPURESA_HOME"; unset GPURESA_HOME; cd "$HOME" && exec /usr/lib/openssh/sftp-server'
    ;;
*)
    enter "GPURESA_HOME=$home" "GPURESA_COMMAND=$SSH_ORIGINAL_COMMAND" /bin/sh -c '[ -d "$GPURESA_HOME" ] || GPURESA_HOME=/root; export HOME="$GPURESA_HOME"; unset GPURESA_HOME; cd "$HOME" && exec /bin/bash -lc '"'"'c=$GPURESA_COMMAND && unset GPURESA_COMMAND && eval "$c"'"'"
    ;;
esac
