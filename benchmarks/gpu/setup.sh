# Source on the GPU machine: the project on PYTHONPATH, and the pure-Python deps it may lack.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
if ! python3 -c "import pydantic, hypothesis, rich" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/py-deps .gpu-wheels/py/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/py-deps
fi
python3 -c "import pydantic, torch; print('pydantic', pydantic.__version__, 'torch', torch.__version__)"
