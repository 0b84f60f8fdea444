#!/bin/sh
# Build-time half of the access layer: run once on top of a template's image.
# Installs what the local base image already has and upstream images often
# lack (sshd, sudo, pkill), removes baked-in host keys and makes sshd and PAM
# work in a user namespace.
set -eu

missing=""
[ -x /usr/sbin/sshd ] || missing="$missing openssh-server"
command -v sudo >/dev/null 2>&1 || missing="$missing sudo"
command -v pkill >/dev/null 2>&1 || missing="$missing procps"
command -v setpriv >/dev/null 2>&1 || missing="$missing util-linux"
command -v wall >/dev/null 2>&1 || missing="$missing bsdutils"
if [ -n "$missing" ]; then
    if command -v apt-get >/dev/null 2>&1; then
        apt-get update
        # shellcheck disable=SC2086  # one word per package
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing
        rm -rf /var/lib/apt/lists/*
    else
        echo "gpuresa access layer: cannot install$missing: the image has no apt-get" >&2
        exit 1
    fi
fi

# A host key per session: gpuresa mounts the session's own; none may come from the image.
rm -f /etc/ssh/ssh_host_*
mkdir -p /run/sshd /etc/gpuresa /var/log/gpuresa
# sshd's AuthorizedKeysCommand runs as this account, which does nothing else
getent passwd gpuresa-keys >/dev/null ||
    useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin \
        --user-group gpuresa-keys
cp /opt/gpuresa/sshd_config /etc/ssh/sshd_config
rm -rf /etc/ssh/sshd_config.d

if [ -f /etc/pam.d/sshd ]; then
    # pam_loginuid cannot write the audit uid inside a user namespace: optional.
    # pam_motd runs the distribution's update-motd scripts: sshd prints our motd instead.
    sed -i \
        -e 's/^\(session[[:space:]]\{1,\}\)required\([[:space:]]\{1,\}pam_loginuid\.so\)/\1optional\2/' \
        -e '/pam_motd\.so/d' \
        /etc/pam.d/sshd
fi
# The login gate: a session is prepared ahead with sshd running, and gpuresa lets
# its user in at the start by removing this file from the read-only folder it
# mounts (pam_nologin refuses every login but root's while the file is there).
echo 'account required pam_nologin.so file=/etc/gpuresa/session/nologin' >>/etc/pam.d/sshd
# The motd and end time are gpuresa's files in the read-only folder it mounts at
# /etc/gpuresa/session (rewritten on the host when the end moves); the
# template's own notes follow the motd in interactive login shells.
rm -rf /etc/motd /etc/update-motd.d/* /etc/gpuresa/end
ln -s /etc/gpuresa/session/motd /etc/motd
ln -s session/end /etc/gpuresa/end
cp /opt/gpuresa/template-motd.sh /etc/profile.d/gpuresa-template-motd.sh
chmod 0644 /etc/profile.d/gpuresa-template-motd.sh
chmod 0755 /opt/gpuresa/entrypoint.sh /opt/gpuresa/notebook.sh
rm -f /opt/gpuresa/Dockerfile /opt/gpuresa/install.sh /opt/gpuresa/template-motd.sh
