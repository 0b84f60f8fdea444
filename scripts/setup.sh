#!/usr/bin/env bash
# Idempotent set-up of the development environment, run by `make setup`:
#   1. .venv with gpuresa and its test extras (reinstalled when pyproject.toml changes);
#   2. a Docker engine with user namespaces and live-restore (installed and started when
#      none answers; live-restore turned on with a reload, never a restart);
#   3. the local base image gpuresa/base:bookworm (rebuilt when its recipe changes);
#   Chromium for the status page's test (installed when missing);
#   4. a rootful Podman API service next to Docker (separate storage in
#      /var/lib/containers, netavark networks), with a `containers` id range for
#      userns=auto, and the base image loaded into it (when its recipe changed);
#   6. a one-node Slurm (scripts/setup_slurm.sh) for the Slurm backend.
#   5. a MariaDB server for the GRR source's tests (Debian's mariadb-server, started
#      directly, without systemd: datadir /var/lib/gpuresa-mariadb, socket
#      /run/gpuresa-mariadb/mysqld.sock and 127.0.0.1:3307; root logs in over the socket).
# Needs root on Debian/Ubuntu for steps 2 to 4 when something is missing.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
BASE_IMAGE=gpuresa/base:bookworm
DOCKERD_LOG=/var/log/gpuresa-dockerd.log
PODMAN_SOCKET=/run/podman/podman.sock
PODMAN_LOG=/var/log/gpuresa-podman.log
# the host ids Podman hands out with userns=auto: 64 sessions of 65536, clear of
# Docker's dockremap range (100000-165535)
PODMAN_ID_RANGE=containers:2000000:4194304

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

apt_updated=0
apt_install() {
    if [ "$(id -u)" != 0 ]; then die "need root to install $* (run: sudo make setup)"; fi
    if [ "$apt_updated" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        apt_updated=1
    fi
    say "installing Debian packages: $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# --- 1. Python environment -------------------------------------------------
stamp_of() { cat pyproject.toml | sha256sum | cut -c1-16; }
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "gpuresa needs Python 3.11 or newer; $PYTHON is $("$PYTHON" --version 2>&1) (set PYTHON=...)"
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || apt_install python3-venv
command -v ssh-keygen >/dev/null 2>&1 || apt_install openssh-client
# udocker sessions (engine = "udocker") run their containers with the host's runc (R1 mode)
[ -x /usr/sbin/runc ] || apt_install runc
# ... and the user's own sshd on the session's port, which enters the container
[ -x /usr/sbin/sshd ] || apt_install openssh-server
if [ ! -x .venv/bin/pip ]; then
    # also a .venv left half-made by a venv module without ensurepip
    say "creating .venv"
    rm -rf .venv
    "$PYTHON" -m venv .venv
fi
if [ "$(cat .venv/.gpuresa-stamp 2>/dev/null || true)" != "$(stamp_of)" ]; then
    say "installing gpuresa and its test extras into .venv"
    # this machine's pip configuration warns about every missing local index folder
    .venv/bin/pip install -q -e ".[test]" 2> >(grep -v '^WARNING: Location' >&2)
    stamp_of > .venv/.gpuresa-stamp
else
    say ".venv is up to date"
fi

# Chromium renders the status page in its test (headless screenshot and DOM dump)
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    apt_install chromium
fi

# lftp is the FTPS client of the tests: the sidecars require the data connection
# to resume the control connection's TLS session, which Python's ftplib cannot
if ! command -v lftp >/dev/null 2>&1; then
    apt_install lftp
fi

# --- 2. Docker engine --------------------------------------------------------
# /etc/docker/daemon.json must say "userns-remap" (a session's root is not the
# host's) and "live-restore": true (an engine upgrade or restart leaves running
# sessions running). Written only when a setting is missing; prints "changed" then.
DAEMON_JSON=${DAEMON_JSON:-/etc/docker/daemon.json}
docker_settings() {
    mkdir -p "$(dirname "$DAEMON_JSON")"
    "$PYTHON" - "$DAEMON_JSON" <<'PY'
import json, os, pathlib, sys
path = pathlib.Path(sys.argv[1])
text = path.read_text() if path.exists() else ""
settings = json.loads(text) if text.strip() else {}
wanted = dict(settings)
wanted.setdefault("userns-remap", "default")
wanted["live-restore"] = True
if wanted != settings:
    temporary = path.with_name(path.name + ".gpuresa-new")
    temporary.write_text(json.dumps(wanted, indent=2) + "\n")
    os.replace(temporary, path)
    print("changed")
PY
}
docker_answers() { timeout 10 docker info >/dev/null 2>&1; }

if docker_answers; then
    if docker info --format '{{json .SecurityOptions}}' | grep -q userns; then
        say "Docker engine answers, with user namespaces"
    else
        say "WARNING: the Docker engine answers but runs WITHOUT user namespaces;"
        say "WARNING: set \"userns-remap\": \"default\" in $DAEMON_JSON and restart it"
    fi
    if [ "$(docker info --format '{{.LiveRestoreEnabled}}' 2>/dev/null)" != true ]; then
        if [ "$(id -u)" != 0 ]; then die "need root to turn on Docker's live-restore (run: sudo make setup)"; fi
        if [ "$(docker_settings)" = changed ]; then
            # live-restore is one of the settings dockerd reloads on SIGHUP: no
            # restart, so no running container is stopped for it
            say "$DAEMON_JSON: live-restore = true; reloading the Docker engine"
            if [ -d /run/systemd/system ] && systemctl is-active --quiet docker 2>/dev/null; then
                systemctl reload docker || true
            elif [ -s /var/run/docker.pid ]; then
                kill -HUP "$(cat /var/run/docker.pid)" || true
            fi
            sleep 1
        fi
        if [ "$(docker info --format '{{.LiveRestoreEnabled}}' 2>/dev/null)" = true ]; then
            say "Docker engine: live-restore on"
        else
            say "WARNING: Docker's live-restore is still off: restart the Docker engine once"
            say "WARNING: (this stops the containers running now)"
        fi
    fi
else
    command -v dockerd >/dev/null 2>&1 || apt_install docker.io
    command -v newuidmap >/dev/null 2>&1 || apt_install uidmap
    if [ "$(docker_settings)" = changed ]; then
        say "$DAEMON_JSON: userns-remap and live-restore set"
    fi
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
        say "starting docker.service"
        systemctl restart docker || true
    else
        say "starting dockerd (log: $DOCKERD_LOG)"
        pkill -x dockerd 2>/dev/null && sleep 2 || true
        rm -f /var/run/docker.pid
        nohup env -C / dockerd >"$DOCKERD_LOG" 2>&1 &
    fi
    for _ in $(seq 60); do
        docker_answers && break
        sleep 1
    done
    if ! docker_answers; then
        tail -n 20 "$DOCKERD_LOG" >&2 2>/dev/null || journalctl -u docker -n 20 >&2 || true
        die "the Docker engine did not answer within 60 s (its log is above)"
    fi
    say "Docker engine answers"
fi

# --- 3. Local base image ------------------------------------------------------
# bump BASE_RECIPE when the mmdebstrap/import lines below change
BASE_RECIPE=1
recipe_hash=$( (echo "$BASE_RECIPE"; cat templates/base/packages.txt) | sha256sum | cut -c1-16)
current=$(docker image inspect --format '{{ index .Config.Labels "gpuresa.recipe" }}' \
          "$BASE_IMAGE" 2>/dev/null || true)
if [ "$current" = "$recipe_hash" ]; then
    say "base image $BASE_IMAGE is up to date"
else
    command -v mmdebstrap >/dev/null 2>&1 || apt_install mmdebstrap
    packages=$(grep -v '^#' templates/base/packages.txt | tr -s '[:space:]' ',' | sed 's/^,//; s/,$//')
    workdir=$(mktemp -d)
    trap 'rm -rf "$workdir"' EXIT
    say "building $BASE_IMAGE with mmdebstrap (about 30 s): $packages"
    mmdebstrap --quiet --variant=minbase --include="$packages" bookworm "$workdir/base.tar" \
        || die "mmdebstrap failed (is the Debian mirror reachable?)"
    docker import \
        --change "LABEL gpuresa.recipe=$recipe_hash" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' \
        "$workdir/base.tar" "$BASE_IMAGE" >/dev/null
    say "built $BASE_IMAGE"
fi

# --- 4. Podman ----------------------------------------------------------------------
podman_answers() {
    timeout 10 curl -sf --unix-socket "$PODMAN_SOCKET" http://podman/_ping >/dev/null 2>&1
}
command -v curl >/dev/null 2>&1 || apt_install curl
# catatonit: the init of containers with "Init": true; netavark and aardvark-dns:
# the networks, with names resolved inside them
for tool in podman catatonit netavark aardvark-dns; do
    if ! command -v "$tool" >/dev/null 2>&1 && [ ! -x "/usr/libexec/podman/$tool" ] \
        && [ ! -x "/usr/lib/podman/$tool" ]; then
        apt_install podman crun catatonit netavark aardvark-dns uidmap
        break
    fi
done
for file in /etc/subuid /etc/subgid; do
    if ! grep -q '^containers:' "$file" 2>/dev/null; then
        if [ "$(id -u)" != 0 ]; then die "need root to add a containers range to $file"; fi
        echo "$PODMAN_ID_RANGE" >> "$file"
        say "$file: $PODMAN_ID_RANGE (the ids Podman's userns=auto hands out)"
    fi
done
if podman_answers; then
    say "Podman API service answers"
else
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
        say "starting podman.socket"
        systemctl enable --now podman.socket
    else
        options=()
        # crun refuses the hybrid cgroup layout (v1 controllers plus a v2 tree that
        # holds controllers of its own); runc, which Docker uses too, does not
        if [ -d /sys/fs/cgroup/unified ] && command -v runc >/dev/null 2>&1; then
            options=(--runtime runc)
        fi
        say "starting the Podman API service ${options[*]} (log: $PODMAN_LOG)"
        mkdir -p "$(dirname "$PODMAN_SOCKET")"
        # from /: a service keeps its working directory, and conmon fails in every
        # container once that folder is gone (a CI checkout removed after its run)
        nohup env -C / podman "${options[@]}" system service --time=0 \
            "unix://$PODMAN_SOCKET" >"$PODMAN_LOG" 2>&1 &
    fi
    for _ in $(seq 60); do
        podman_answers && break
        sleep 1
    done
    if ! podman_answers; then
        tail -n 20 "$PODMAN_LOG" >&2 2>/dev/null || journalctl -u podman -n 20 >&2 || true
        die "the Podman API service did not answer within 60 s (its log is above)"
    fi
    say "Podman API service answers"
fi
# A Podman service killed while removing a container leaves its port forwarding behind
# (netavark's DNAT rules): a later session published on that port would have its traffic
# sent to the gone container's address. Drop the rules of containers that no longer exist.
if command -v iptables >/dev/null 2>&1; then
    while IFS= read -r rule; do
        id=$(sed -n 's/.* id: \([0-9a-f]\{64\}\).*/\1/p' <<<"$rule")
        [ -n "$id" ] || continue
        podman container exists "$id" 2>/dev/null && continue
        say "removing the port forwarding of a gone Podman container (${id:0:12})"
        eval "iptables -t nat ${rule/#-A /-D }" || true
    done < <(iptables -t nat -S NETAVARK-HOSTPORT-DNAT 2>/dev/null | grep '^-A ' || true)
fi
# the base image exists only in Docker: load it into Podman when its recipe changed
in_podman=$(podman image inspect --format '{{ index .Labels "gpuresa.recipe" }}' \
            "$BASE_IMAGE" 2>/dev/null || true)
if [ "$in_podman" = "$recipe_hash" ]; then
    say "base image $BASE_IMAGE in Podman is up to date"
else
    say "loading $BASE_IMAGE into Podman"
    docker save "$BASE_IMAGE" | podman load -q >/dev/null \
        || die "could not load $BASE_IMAGE into Podman"
fi

# --- 5. MariaDB (the GRR source's tests) --------------------------------------------
MARIADB_DATADIR=/var/lib/gpuresa-mariadb
MARIADB_RUN=/run/gpuresa-mariadb
MARIADB_SOCKET=$MARIADB_RUN/mysqld.sock
MARIADB_PORT=3307
MARIADB_LOG=/var/log/gpuresa-mariadb.log
mariadb_answers() {
    timeout 10 mariadb --protocol=socket --socket="$MARIADB_SOCKET" -u root \
        -e 'SELECT 1' >/dev/null 2>&1
}
if mariadb_answers; then
    say "MariaDB answers on $MARIADB_SOCKET"
else
    if ! command -v mariadbd >/dev/null 2>&1 && [ ! -x /usr/sbin/mariadbd ]; then
        # a packaged mariadb.service, where systemd starts one, is left alone: ours
        # has its own datadir, socket and port
        apt_install mariadb-server mariadb-client
    fi
    mkdir -p "$MARIADB_RUN"
    chown mysql:mysql "$MARIADB_RUN"
    if [ ! -d "$MARIADB_DATADIR/mysql" ]; then
        say "creating the MariaDB datadir $MARIADB_DATADIR"
        mkdir -p "$MARIADB_DATADIR"
        chown mysql:mysql "$MARIADB_DATADIR"
        mariadb-install-db --user=mysql --datadir="$MARIADB_DATADIR" \
            --auth-root-authentication-method=socket >/dev/null \
            || die "mariadb-install-db failed"
    fi
    say "starting MariaDB (log: $MARIADB_LOG)"
    # --no-defaults: nothing from /etc/mysql (the packaged server's socket and port)
    nohup env -C / /usr/sbin/mariadbd --no-defaults --user=mysql \
        --datadir="$MARIADB_DATADIR" --socket="$MARIADB_SOCKET" \
        --pid-file="$MARIADB_RUN/mysqld.pid" --bind-address=127.0.0.1 --port="$MARIADB_PORT" \
        --skip-name-resolve --innodb-buffer-pool-size=64M >"$MARIADB_LOG" 2>&1 &
    for _ in $(seq 60); do
        mariadb_answers && break
        sleep 1
    done
    if ! mariadb_answers; then
        tail -n 20 "$MARIADB_LOG" >&2 2>/dev/null || true
        die "MariaDB did not answer within 60 s (its log is above)"
    fi
    say "MariaDB answers on $MARIADB_SOCKET and 127.0.0.1:$MARIADB_PORT"
fi
bash scripts/setup_slurm.sh
say "ready"
