# The session template's own notes, after gpuresa's motd, in interactive login shells.
case $- in
*i*)
    # the template's browser tools: the ssh -L lines and URLs with this session's token
    # (gpuresa's file, readable by the login alone)
    if [ -r /etc/gpuresa/session/tools ]; then
        sed 's/^/  /' /etc/gpuresa/session/tools
        echo
    fi
    if [ -s /etc/gpuresa/template-motd ]; then
        sed 's/^/  /' /etc/gpuresa/template-motd
        echo
    fi
    ;;
esac
