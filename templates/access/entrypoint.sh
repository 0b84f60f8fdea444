#!/bin/sh
# Start-up of a gpuresa session container (docker-init runs it as PID 1's child).
# Given by gpuresa in the environment: GPURESA_USER, GPURESA_UID; arguments:
# the template's command, if any.
# Makes the login (once: a restarted container keeps it) and its sudo rule,
# then runs sshd in the foreground with the session's host key. The banner,
# motd, end time and the user's authorized keys are not made here: gpuresa writes them on the
# host, in the folder mounted read-only at /etc/gpuresa/session.
set -eu

fail() {
    echo "gpuresa entrypoint: $*" >&2
    exit 1
}

login="${GPURESA_USER:?GPURESA_USER is not set}"
uid="${GPURESA_UID:?GPURESA_UID is not set}"
echo "$login" | grep -Eqx '[a-z_][a-z0-9_-]{0,31}' || fail "not a valid login: $login"
echo "$uid" | grep -Eqx '[1-9][0-9]{0,4}' || fail "not a valid uid: $uid"

# --- the account, its sudo rule and its keys -----------------------------------
existing_uid=$(getent passwd "$login" | cut -d: -f3 || true)
if [ -z "$existing_uid" ]; then
    if ! getent group "$login" >/dev/null; then
        groupadd --non-unique --gid "$uid" "$login"
    fi
    useradd --non-unique --uid "$uid" --gid "$login" --create-home --shell /bin/bash "$login"
    # unlocked with no password: sshd refuses locked accounts, passwords are never accepted
    usermod --password '*' "$login"
elif [ "$existing_uid" != "$uid" ]; then
    # the image already has this login (a system account): never take it over
    fail "the image already has a login $login (uid $existing_uid)"
fi
home=$(getent passwd "$login" | cut -d: -f6)

printf '%s ALL=(ALL:ALL) NOPASSWD: ALL\nDefaults:%s secure_path="%s"\n' \
    "$login" "$login" "$PATH" >/etc/sudoers.d/gpuresa
chmod 0440 /etc/sudoers.d/gpuresa

[ -s /etc/gpuresa/session/authorized_keys ] ||
    fail "/etc/gpuresa/session/authorized_keys is missing (gpuresa writes it on the host)"

# --- the host key: the session's own when gpuresa mounts it, with its certificate
# (signed by the host's CA for this session's time; sshd re-executes itself for
# every connection and reads the certificate then, so a renewed one counts at
# once), else one made here (no slow RSA) --------------------------------------------
mounted=/etc/ssh/gpuresa-host-keys/ssh_host_ed25519_key
if [ -s "$mounted" ]; then
    host_key_options="-h $mounted -o HostCertificate=$mounted-cert.pub"
else
    key=/etc/ssh/ssh_host_ed25519_key
    [ -s "$key" ] || ssh-keygen -q -t ed25519 -N '' -C "gpuresa-${GPURESA_SESSION:-session}" -f "$key"
    host_key_options="-h $key"
fi

# --- the environment of login sessions: the image's, plus the GPUs' ---------------
# (sshd starts sessions with a clean environment; PAM reads /etc/environment,
# login shells /etc/profile.d)
if [ -d /usr/local/nvidia/lib64 ]; then
    LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LD_LIBRARY_PATH
fi
if [ -d /usr/local/nvidia/bin ]; then
    PATH="/usr/local/nvidia/bin:$PATH"
    export PATH
fi
environment_file=/etc/environment
profile_file=/etc/profile.d/gpuresa.sh
: >"$environment_file.new"
: >"$profile_file.new"
# (awk lists the names exactly; parsing `env` would split multi-line values)
for name in $(awk 'BEGIN { for (name in ENVIRON) print name }' | sort); do
    case "$name" in
    '' | [0-9]* | *[!A-Za-z0-9_]* | GPURESA_* | HOSTNAME | HOME | PWD | OLDPWD | SHLVL | TERM | USER | LOGNAME | SHELL | MAIL | _)
        continue
        ;;
    esac
    eval "value=\${$name}"
    case "$value" in
    *'"'* | *"'"* | *'\'* | *'
'*)
        # a value pam_env or the shell quoting below cannot carry: left out
        continue
        ;;
    esac
    printf '%s="%s"\n' "$name" "$value" >>"$environment_file.new"
    printf "export %s='%s'\n" "$name" "$value" >>"$profile_file.new"
done
mv "$environment_file.new" "$environment_file"
mv "$profile_file.new" "$profile_file"

# --- utmp, so that `wall` reaches logins ----------------------------------------------
touch /var/run/utmp
chgrp utmp /var/run/utmp 2>/dev/null || true
chmod 0664 /var/run/utmp

# --- the template's browser tools, in the background as the user -------------------
# gpuresa writes each started tool's command in the session's folder (its arguments,
# NUL-ended) with the session's token, readable by the login alone; the tool listens on
# a unix socket in the login's own folder here, which sshd forwards to (ssh -L) and
# nobody outside the session reaches (see gpuresa.sessions.tools). Nothing waits for it.
tools_dir="${GPURESA_TOOLS_DIR:-/run/gpuresa-tools}"
for command_file in /etc/gpuresa/session/tool-*.command; do
    [ -f "$command_file" ] || continue
    name=${command_file##*/tool-}
    name=${name%.command}
    echo "$name" | grep -Eqx '[a-z][a-z0-9-]{0,30}' || continue
    mkdir -p "$tools_dir"
    chown "$uid:$uid" "$tools_dir"
    chmod 0700 "$tools_dir"
    tool_log="/var/log/gpuresa/tool-$name.log"
    : >>"$tool_log"
    chown "$uid:$uid" "$tool_log"
    echo "gpuresa entrypoint: starting the tool $name as $login" >&2
    (
        cd "$home"
        exec env HOME="$home" USER="$login" LOGNAME="$login" \
            GPURESA_TOOL_SOCKET="$tools_dir/$name.sock" \
            GPURESA_TOOL_TOKEN_FILE=/etc/gpuresa/session/tool-token \
            xargs -0 -a "$command_file" setpriv --reuid="$uid" --regid="$uid" --init-groups --
    ) >>"$tool_log" 2>&1 </dev/null &
done

# --- the template's command, in the background as the user --------------------------
if [ "$#" -gt 0 ]; then
    echo "gpuresa entrypoint: starting the template's command as $login: $*" >&2
    (
        cd "$home"
        exec env HOME="$home" USER="$login" LOGNAME="$login" \
            setpriv --reuid="$uid" --regid="$uid" --init-groups -- "$@"
    ) >>/var/log/gpuresa/command.log 2>&1 &
fi

mkdir -p /run/sshd
chmod 0755 /run/sshd
echo "gpuresa entrypoint: session ${GPURESA_SESSION:-?} ready for $login (uid $uid)" >&2
# shellcheck disable=SC2086 # the options are words without spaces
exec /usr/sbin/sshd -D -e $host_key_options -o "AllowUsers=$login"
