#!/bin/sh
# Record the session's end and show it in the login banner and the motd.
# Given: $1 the end in ISO 8601 (UTC), $2 the same written for people.
# Run by the entrypoint, and by gpuresa (docker exec) when the booking moves.
set -eu
end="${1:?usage: set-end.sh END_ISO [END_TEXT]}"
text="${2:-$end}"
login="${GPURESA_USER:-}"
template="${GPURESA_TEMPLATE:-}${GPURESA_CUDA:+ (CUDA $GPURESA_CUDA)}"
gpus="${GPURESA_GPUS:-none}"
output="${GPURESA_OUTPUT:-/output}"
inputs=$(printf '%s' "${GPURESA_INPUTS:-}" | tr ':' ' ')

mkdir -p /etc/gpuresa
printf '%s\n' "$end" >/etc/gpuresa/end.new
mv /etc/gpuresa/end.new /etc/gpuresa/end

printf 'gpuresa session of %s, template %s: ends at %s\n' "$login" "$template" "$text" \
    >/etc/gpuresa/banner.new
mv /etc/gpuresa/banner.new /etc/gpuresa/banner

{
    printf '\n  gpuresa session of %s: template %s, GPUs: %s\n' "$login" "$template" "$gpus"
    printf '  Ends at %s; the container and everything outside %s are then deleted.\n' \
        "$text" "$output"
    printf '  Keep your results in %s (also served by FTP, kept after the session).\n' "$output"
    if [ -n "$inputs" ]; then
        printf '  Input data (read-only): %s\n' "$inputs"
    fi
    if [ -s /etc/gpuresa/template-motd ]; then
        sed 's/^/  /' /etc/gpuresa/template-motd
    fi
    printf '\n'
} >/etc/motd.new
mv /etc/motd.new /etc/motd
