#!/bin/sh
# Start-up of the output service: check what gpuresa mounted, then sshd.
set -eu
for file in /etc/gpuresa-outputs/passwd /etc/gpuresa-outputs/group \
    /etc/gpuresa-host-keys/ssh_host_ed25519_key; do
    [ -s "$file" ] || { echo "gpuresa outputs: $file is missing" >&2; exit 1; }
done
# The engine keeps image files with its remapped owner even for a container in
# the host's user namespace; sshd accepts a chroot (and key files) only below
# folders owned by root, so / and /etc become root's (in this container's own
# writable layer: nothing on the host changes).
chown 0:0 / /etc
# the accounts are gpuresa's, from the folder it mounts (see install.sh)
ln -sf /etc/gpuresa-outputs/passwd /etc/passwd
ln -sf /etc/gpuresa-outputs/group /etc/group
# /run is a tmpfs: sshd's privilege separation folder is made on each start
mkdir -p /run/sshd
chmod 0755 /run/sshd
echo "gpuresa outputs: serving /outputs over SFTP (read-only, one chroot per login)" >&2
# CHOWN was for the line above only, SETPCAP only to drop it: sshd runs without both
exec setpriv --inh-caps=-chown,-setpcap --bounding-set=-chown,-setpcap -- /usr/sbin/sshd -D -e
