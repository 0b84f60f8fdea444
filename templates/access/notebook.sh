#!/bin/sh
# JupyterLab of a gpuresa session (else the classic Notebook, else nothing), as the
# booked user. Started by the session's first process when a template declares it
# (`[[tools]]` in template.toml), with, in the environment:
#   GPURESA_TOOL_SOCKET      the unix socket to listen on (in a folder only the login enters)
#   GPURESA_TOOL_TOKEN_FILE  the file holding the session's token (readable by the login alone)
# The token goes through the environment, never the command line (which every host user
# of a udocker session sees). No TCP port is opened.
set -eu
socket="${GPURESA_TOOL_SOCKET:?GPURESA_TOOL_SOCKET is not set}"
JUPYTER_TOKEN=$(cat "${GPURESA_TOOL_TOKEN_FILE:?GPURESA_TOOL_TOKEN_FILE is not set}")
export JUPYTER_TOKEN
# the server's and kernels' runtime files (kernel keys included) beside the socket, in
# the login's folder of this session rather than in a home other sessions share
JUPYTER_RUNTIME_DIR="$(dirname "$socket")/jupyter-runtime"
export JUPYTER_RUNTIME_DIR
rm -f "$socket"
umask 077
# a udocker session's login is uid 0 of its user namespace (no other id exists there),
# which Jupyter refuses unless told; elsewhere the tool never runs as root
lab_root="--ServerApp.allow_root=False"
notebook_root="--NotebookApp.allow_root=False"
if [ "$(id -u)" -eq 0 ]; then
    lab_root="--ServerApp.allow_root=True"
    notebook_root="--NotebookApp.allow_root=True"
fi

if command -v jupyter-lab >/dev/null 2>&1; then
    exec jupyter-lab --no-browser --ServerApp.sock="$socket" --ServerApp.sock_mode=0600 \
        --ServerApp.root_dir="$PWD" "$lab_root"
fi
for python in python3 python; do
    if "$python" -c 'import jupyterlab' >/dev/null 2>&1; then
        exec "$python" -m jupyterlab --no-browser --ServerApp.sock="$socket" \
            --ServerApp.sock_mode=0600 --ServerApp.root_dir="$PWD" "$lab_root"
    fi
done
if command -v jupyter-notebook >/dev/null 2>&1; then
    exec jupyter-notebook --no-browser --sock="$socket" --sock-mode=0600 \
        --NotebookApp.notebook_dir="$PWD" "$notebook_root"
fi
echo "gpuresa notebook: this image has neither JupyterLab nor the Notebook" >&2
exit 0
