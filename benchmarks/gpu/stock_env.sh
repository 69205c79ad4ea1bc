# Source on the GPU machine for a stock `pip install torch`: the project and its pure-Python deps on PYTHONPATH,
# nothing from /tmp/gpu-site (no cudnn-frontend, no flash-attn-4).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/py-deps
if ! python3 -c "import pydantic, rich" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/py-deps .gpu-wheels/py/*.whl
fi
