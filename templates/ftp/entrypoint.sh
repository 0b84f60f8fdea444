#!/bin/sh
# Start-up of a gpuresa session's FTP sidecar. Given in the environment:
# FTP_USER, FTP_UID (the session login's uid: files it writes belong to the
# same user inside the session), FTP_PASSWORD, FTP_PASSIVE_FIRST/LAST (the
# published passive ports) and FTP_PASSIVE_ADDRESS (the IPv4 address PASV
# announces, the host's; empty: vsftpd announces its own).
set -eu

fail() {
    echo "gpuresa ftp: $*" >&2
    exit 1
}

login="${FTP_USER:?FTP_USER is not set}"
uid="${FTP_UID:?FTP_UID is not set}"
password="${FTP_PASSWORD:?FTP_PASSWORD is not set}"
echo "$login" | grep -Eqx '[a-z_][a-z0-9_-]{0,31}' || fail "not a valid login: $login"
echo "$uid" | grep -Eqx '[1-9][0-9]{0,4}' || fail "not a valid uid: $uid"

existing_uid=$(getent passwd "$login" | cut -d: -f3 || true)
if [ -z "$existing_uid" ]; then
    getent group "$login" >/dev/null || groupadd --non-unique --gid "$uid" "$login"
    useradd --non-unique --uid "$uid" --gid "$login" --home-dir /output --no-create-home \
        --shell /usr/sbin/nologin "$login"
elif [ "$existing_uid" != "$uid" ]; then
    fail "the image already has a login $login (uid $existing_uid)"
fi
printf '%s:%s\n' "$login" "$password" | chpasswd
printf '%s\n' "$login" >/etc/gpuresa-ftp.users

config=/etc/vsftpd-gpuresa.conf
{
    cat /opt/gpuresa-ftp/vsftpd.conf
    printf 'pasv_min_port=%s\npasv_max_port=%s\n' \
        "${FTP_PASSIVE_FIRST:?FTP_PASSIVE_FIRST is not set}" \
        "${FTP_PASSIVE_LAST:?FTP_PASSIVE_LAST is not set}"
    if [ -n "${FTP_PASSIVE_ADDRESS:-}" ]; then
        printf 'pasv_address=%s\n' "$FTP_PASSIVE_ADDRESS"
    fi
    printf 'ftpd_banner=gpuresa: output of session %s\n' "${GPURESA_SESSION:-}"
    # explicit TLS (FTPS) with the host's certificate; plain FTP only when the
    # config asks for it (FTP_PLAIN=yes)
    tls=/etc/gpuresa-ftp/tls
    if [ -s "$tls/cert.pem" ] && [ -s "$tls/key.pem" ]; then
        printf 'ssl_enable=YES\nrsa_cert_file=%s\nrsa_private_key_file=%s\n' \
            "$tls/cert.pem" "$tls/key.pem"
        # a data connection must resume the control connection's TLS session: one
        # from anyone else (a race for the passive port from behind the same NAT or
        # Docker's proxy, where every client has one address) is refused
        printf 'require_ssl_reuse=YES\nssl_ciphers=HIGH\nallow_anon_ssl=NO\n'
        printf 'ssl_sslv2=NO\nssl_sslv3=NO\nssl_tlsv1=NO\n'
        if [ "${FTP_PLAIN:-no}" = yes ]; then
            printf 'force_local_logins_ssl=NO\nforce_local_data_ssl=NO\n'
        else
            printf 'force_local_logins_ssl=YES\nforce_local_data_ssl=YES\n'
        fi
    elif [ "${FTP_PLAIN:-no}" != yes ]; then
        fail "no certificate in $tls and plain FTP is not allowed (storage.ftp_plain)"
    fi
} >"$config"
mkdir -p /var/run/vsftpd/empty
echo "gpuresa ftp: serving /output to $login (uid $uid)" >&2
exec /usr/sbin/vsftpd "$config"
