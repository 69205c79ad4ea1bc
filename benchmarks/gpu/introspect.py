"""Print the engine APIs as installed on the GPU machine (signatures, schemas, docstrings)."""
import inspect
import sys

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for op in ("_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_cudnn_attention",
           "_scaled_dot_product_cudnn_attention_backward", "_scaled_dot_product_flash_attention",
           "_efficient_attention_forward", "_cudnn_attention_forward"):
    try:
        print(op, "::", getattr(torch.ops.aten, op).default._schema)
    except Exception as exc:  # noqa: BLE001
        print(op, "missing:", exc)
what = sys.argv[1:] or ["cudnn"]
if "cudnn" in what:
    try:
        import cudnn
        print("cudnn-frontend", cudnn.__version__, "backend", cudnn.backend_version())
        g = cudnn.pygraph
        for name in ("sdpa", "sdpa_backward"):
            print(f"--- pygraph.{name} doc ---")
            print(getattr(g, name).__doc__)
        print("pygraph init doc:", g.__init__.__doc__)
    except Exception as exc:  # noqa: BLE001
        print("cudnn import failed", repr(exc))
if "fa4" in what:
    try:
        import flash_attn.cute as fc
        import flash_attn.cute.interface as fi
        print("flash_attn.cute exports:", [n for n in dir(fc) if not n.startswith("__")])
        for name in dir(fi):
            obj = getattr(fi, name)
            if callable(obj) and (name.startswith("flash") or name.startswith("_flash")):
                try:
                    print(name, inspect.signature(obj))
                except (TypeError, ValueError):
                    print(name, "(no signature)")
        src = inspect.getsource(fi)
        print("interface.py lines:", src.count("\n"))
        open(sys.argv[-1] if sys.argv[-1].endswith(".py") else "/dev/null", "w").write(src)
    except Exception:  # noqa: BLE001
        import traceback
        traceback.print_exc()
