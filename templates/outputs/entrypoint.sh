#!/bin/sh
# Start-up of the output service: check what gpuresa mounted, then sshd.
set -eu
for file in /etc/gpuresa-outputs/passwd /etc/gpuresa-outputs/group \
    /etc/gpuresa-host-keys/ssh_host_ed25519_key; do
    [ -s "$file" ] || { echo "gpuresa outputs: $file is missing" >&2; exit 1; }
done
# /run is a tmpfs: sshd's privilege separation folder is made on each start
mkdir -p /run/sshd
chmod 0755 /run/sshd
echo "gpuresa outputs: serving /outputs over SFTP (read-only, one chroot per login)" >&2
exec /usr/sbin/sshd -D -e
