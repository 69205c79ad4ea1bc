# Source on the GPU machine: the project on PYTHONPATH, and the pure-Python deps it may lack.
# Later calls on a warm machine need no carried bundle: what earlier calls unpacked under /tmp is found here.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ -f /tmp/gpu-site/.b-done ] && [[ ":$PYTHONPATH:" != *":/tmp/gpu-site:"* ]]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/gpu-site:/tmp/gpu-site/nvidia_cutlass_dsl/dsl_packages
fi
[ -d /tmp/py-deps ] && export PYTHONPATH=$PYTHONPATH:/tmp/py-deps
if ! python3 -c "import pydantic, hypothesis, rich" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/py-deps .gpu-wheels/py/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/py-deps
fi
python3 -c "import pydantic, torch; print('pydantic', pydantic.__version__, 'torch', torch.__version__)"
