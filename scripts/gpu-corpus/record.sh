#!/bin/bash
# Records tests/corpus/gpus on a GPU host with PyTorch and nvidia-ml-py:
#   OUT=folder bash scripts/gpu-corpus/record.sh
# nvidia-smi XML and NVML answers while idle, during a matmul loop, and after it.
set -x
D=$(dirname "$0")
python3 -c 'import pynvml, torch; print(pynvml.__file__, torch.__version__)' > $OUT/versions.txt 2>&1
nvidia-smi >> $OUT/versions.txt 2>&1
pip show nvidia-ml-py >> $OUT/versions.txt 2>&1
stat -fc %T /sys/fs/cgroup > $OUT/host.txt; cat /proc/self/cgroup >> $OUT/host.txt; ls -l /dev/nvidia* >> $OUT/host.txt 2>&1
ls /dev/nvidia-caps >> $OUT/host.txt 2>&1
( time nvidia-smi -q -x > $OUT/nvidia-smi-idle.xml ) 2>> $OUT/timing.txt
python3 $D/record_nvml.py idle > $OUT/nvml-idle.json 2> $OUT/nvml-idle.err
python3 $D/matmul.py 25 > $OUT/matmul.log 2>&1 &
PID=$!
echo "matmul pid $PID" >> $OUT/host.txt
sleep 10
cat /proc/$PID/cgroup >> $OUT/host.txt
cat /proc/$PID/status | grep -i -E '^(uid|name)' >> $OUT/host.txt
( time nvidia-smi -q -x > $OUT/nvidia-smi-busy.xml ) 2>> $OUT/timing.txt
python3 $D/record_nvml.py busy > $OUT/nvml-busy.json 2> $OUT/nvml-busy.err
nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv >> $OUT/host.txt
wait $PID
nvidia-smi -q -x > $OUT/nvidia-smi-after.xml
python3 $D/record_nvml.py after > $OUT/nvml-after.json 2> $OUT/nvml-after.err
echo done
