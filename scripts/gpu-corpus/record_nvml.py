"""Record what NVML answers, call by call, into JSON (replayed by tests/nvml_replay.py).

Run on a GPU host by record.sh; records more calls than the gateway makes, so
the gateway can change without a new recording.
"""

import json
import sys
import time

import pynvml

calls = []
handles = {}


def convert(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [convert(v) for v in value]
    if hasattr(value, "_fields_"):
        out = {}
        for name, *_ in value._fields_:
            out[name] = convert(getattr(value, name))
        return out
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    if hasattr(value, "__dict__"):
        return {name: convert(item) for name, item in vars(value).items()}
    return repr(value)


def call(function, *args):
    shown = [handles.get(id(a), a) if not isinstance(a, (int, str)) else a for a in args]
    record = {"function": function, "args": shown}
    try:
        result = getattr(pynvml, function)(*args)
    except pynvml.NVMLError as error:
        record["error"] = error.value
        record["message"] = str(error)
        calls.append(record)
        return None
    record["result"] = convert(result)
    calls.append(record)
    return result


start = time.monotonic()
call("nvmlInit")
call("nvmlSystemGetDriverVersion")
call("nvmlSystemGetNVMLVersion")
call("nvmlSystemGetCudaDriverVersion")
count = call("nvmlDeviceGetCount") or 0
for index in range(count):
    handle = call("nvmlDeviceGetHandleByIndex", index)
    handles[id(handle)] = f"handle:{index}"
    calls[-1]["result"] = f"handle:{index}"
    uuid = call("nvmlDeviceGetUUID", handle)
    by_uuid = call("nvmlDeviceGetHandleByUUID", uuid)
    if by_uuid is not None:
        calls[-1]["result"] = f"handle:{index}"
    for function in [
        "nvmlDeviceGetName",
        "nvmlDeviceGetIndex",
        "nvmlDeviceGetMinorNumber",
        "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetSerial",
        "nvmlDeviceGetMigMode",
    ]:
        call(function, handle)
    call("nvmlDeviceGetTemperature", handle, 0)
    call("nvmlDeviceGetProcessUtilization", handle, 0)
call("nvmlShutdown")
elapsed = time.monotonic() - start
# time a plain sample loop (the gateway's cost per sample)
pynvml.nvmlInit()
t0 = time.monotonic()
for _ in range(20):
    for index in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        pynvml.nvmlDeviceGetUUID(h)
        pynvml.nvmlDeviceGetName(h)
        pynvml.nvmlDeviceGetUtilizationRates(h)
        pynvml.nvmlDeviceGetMemoryInfo(h)
        pynvml.nvmlDeviceGetComputeRunningProcesses(h)
sample_seconds = (time.monotonic() - t0) / 20
pynvml.nvmlShutdown()
json.dump(
    {
        "recorded": sys.argv[1],
        "pynvml_version": getattr(pynvml, "__version__", "?"),
        "seconds_first_pass": elapsed,
        "seconds_per_sample": sample_seconds,
        "calls": calls,
    },
    sys.stdout,
    indent=1,
)
