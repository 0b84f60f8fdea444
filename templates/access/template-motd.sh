# The session template's own notes, after gpuresa's motd, in interactive login shells.
case $- in
*i*)
    if [ -s /etc/gpuresa/template-motd ]; then
        sed 's/^/  /' /etc/gpuresa/template-motd
        echo
    fi
    ;;
esac
