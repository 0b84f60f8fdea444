#!/bin/sh
# Build-time half of the FTP sidecar: vsftpd and a PAM service of its own.
set -eu
if ! command -v vsftpd >/dev/null 2>&1 && [ ! -x /usr/sbin/vsftpd ]; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends vsftpd
    rm -rf /var/lib/apt/lists/*
fi
mkdir -p /var/run/vsftpd/empty /var/log/gpuresa
cp /opt/gpuresa-ftp/pam /etc/pam.d/gpuresa-ftp
chmod 0755 /opt/gpuresa-ftp/entrypoint.sh
rm -f /opt/gpuresa-ftp/Dockerfile /opt/gpuresa-ftp/install.sh /opt/gpuresa-ftp/pam
