#!/bin/sh
# Build-time half of the output service: sshd, and the account files taken
# from the folder gpuresa mounts (so a new login needs no restart).
set -eu
if [ ! -x /usr/sbin/sshd ]; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openssh-server
    rm -rf /var/lib/apt/lists/*
fi
rm -f /etc/ssh/ssh_host_* /etc/motd
rm -rf /etc/ssh/sshd_config.d
cp /opt/gpuresa-outputs/sshd_config /etc/ssh/sshd_config
# the accounts are gpuresa's (root, sshd's privilege separation user, the logins):
# the entrypoint links /etc/passwd and /etc/group to the folder gpuresa mounts.
# Not here: Podman reads the image's /etc/passwd before the mounts are made, and
# refuses to start a container whose /etc/passwd is a dangling link.
rm -f /etc/shadow /etc/gshadow
chmod 0755 /opt/gpuresa-outputs/entrypoint.sh
rm -f /opt/gpuresa-outputs/Dockerfile /opt/gpuresa-outputs/install.sh \
    /opt/gpuresa-outputs/sshd_config
