#!/bin/sh
# The first process of a gpuresa udocker session, in its container, as the
# namespace's root (the booking user's own uid on the host). Given in the
# environment: GPURESA_USER, GPURESA_SESSION; arguments: the template's command.
# Names uid 0 after the login, makes apt and sudo work with the one id the
# namespace has, writes the login environment, then waits for the stop.
set -eu
login="${GPURESA_USER:?GPURESA_USER is not set}"
mkdir -p /var/log/gpuresa
exec >>/var/log/gpuresa/session.log 2>&1

# uid 0 is the login here: the first passwd line for it names it
if ! grep -q "^$login:" /etc/passwd; then
    sed -i "1i $login:x:0:0:$login:/root:/bin/bash" /etc/passwd
fi
# apt drops to _apt for downloads, an id this namespace does not map
if [ -d /etc/apt ]; then
    mkdir -p /etc/apt/apt.conf.d
    echo 'APT::Sandbox::User "root";' >/etc/apt/apt.conf.d/99gpuresa-sandbox
fi
# sudo cannot change ids here (there is no other id): the login already is this
# namespace's root, so sudo only runs the command
cat >/usr/local/sbin/sudo <<'SUDO'
#!/bin/sh
while [ "$#" -gt 0 ]; do
    case "$1" in
    --) shift; break ;;
    -u | -g | -C | -D | -h | -p | -r | -t | -U) shift 2 ;;
    -i | -s) shift; [ "$#" -eq 0 ] && exec /bin/bash -l; exec /bin/bash -c "$*" ;;
    -*) shift ;;
    *) break ;;
    esac
done
[ "$#" -eq 0 ] && exit 0
exec "$@"
SUDO
chmod 0755 /usr/local/sbin/sudo
rm -f /etc/motd && ln -s /etc/gpuresa/session/motd /etc/motd
rm -f /etc/gpuresa/end && ln -s session/end /etc/gpuresa/end

# the login environment: this container's, for login shells that start clean
if [ -d /usr/local/nvidia/lib64 ]; then
    export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
[ -d /usr/local/nvidia/bin ] && export PATH="/usr/local/nvidia/bin:$PATH"
: >/etc/profile.d/gpuresa.sh.new
for name in $(awk 'BEGIN { for (name in ENVIRON) print name }' | sort); do
    case "$name" in
    '' | [0-9]* | *[!A-Za-z0-9_]* | GPURESA_* | HOSTNAME | HOME | PWD | OLDPWD | SHLVL | TERM | USER | LOGNAME | SHELL | MAIL | _) continue ;;
    esac
    eval "value=\${$name}"
    case "$value" in *"'"* | *'
'*) continue ;; esac
    printf "export %s='%s'\n" "$name" "$value" >>/etc/profile.d/gpuresa.sh.new
done
mv /etc/profile.d/gpuresa.sh.new /etc/profile.d/gpuresa.sh

# the template's browser tools, in the background: each one's command is in the session's
# folder (its arguments, NUL-ended); their sockets go in the login's folder that gpuresa
# binds at the same path as on the host, where the login's sshd forwards to them
if [ -n "${GPURESA_TOOLS_DIR:-}" ]; then
    for command_file in /etc/gpuresa/session/tool-*.command; do
        [ -f "$command_file" ] || continue
        name=${command_file##*/tool-}
        name=${name%.command}
        echo "gpuresa: starting the tool $name"
        (
            cd /root
            exec env GPURESA_TOOL_SOCKET="$GPURESA_TOOLS_DIR/$name.sock" \
                GPURESA_TOOL_TOKEN_FILE=/etc/gpuresa/session/tool-token \
                xargs -0 -a "$command_file" /bin/sh -c 'exec "$@"' gpuresa-tool
        ) >>"/var/log/gpuresa/tool-$name.log" 2>&1 </dev/null &
    done
fi

if [ "$#" -gt 0 ]; then
    echo "gpuresa: starting the template's command: $*"
    (cd /root && exec "$@") >>/var/log/gpuresa/command.log 2>&1 &
fi
echo "gpuresa: session ${GPURESA_SESSION:-?} of $login ready"
exec sleep infinity
