import json
import subprocess
import sys

from attn_dispatch.cli import main

TE_ARGS = ["explain", "--dtype", "bf16", "--batch", "48", "--seqlen", "16534", "--heads", "18", "--head-dim", "128",
           "--mask", "causal", "--cp-size", "2", "--cp-comm", "p2p"]


def test_explain_what_if_a100_cudnn8(capsys, monkeypatch):
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    code = main(TE_ARGS + ["--platform", "sm80,cudnn=8.9.7,flash-attn=2.4.2"])
    out = capsys.readouterr().out
    assert code == 1
    assert "16534" in out and "16576" in out and "NONE" in out


def test_explain_on_hopper_picks_and_json_is_a_decision(capsys):
    assert main(TE_ARGS + ["--platform", "h100-cudnn9", "--json"]) == 0
    decision = json.loads(capsys.readouterr().out)
    assert decision["chosen"] and decision["params"]["max_seqlen_q"] == 16534
    assert {v["backend"] for v in decision["verdicts"]} >= {"cudnn_fused", "unfused"}


def test_bad_arguments_exit_2_with_a_message(capsys):
    assert main(["explain", "--heads", "12", "--kv-heads", "5", "--platform", "cpu"]) == 2
    assert "num_gqa_groups=5" in capsys.readouterr().err
    assert main(["explain", "--platform", "sm80,cudnn=new"]) == 2


def test_platform_command_and_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "attn_dispatch", "platform", "--platform", "h100-cudnn9"],
                            capture_output=True, text=True, check=True)
    assert "sm90" in result.stdout and "cudnn-frontend" in result.stdout and "flash_attn_4:cute" in result.stdout


def test_explain_reads_an_idle_window_as_the_module_does(capsys):
    args = ["explain", "--platform", "h100-cudnn9", "--mask", "causal", "--seqlen", "2048", "--head-dim", "64",
            "--inference", "--json"]
    assert main(args + ["--window", "2048,0"]) == 0
    idle = json.loads(capsys.readouterr().out)
    assert idle["params"]["window_size"] == [-1, 0] and "masks nothing" in idle["notes"][0]
    assert main(args + ["--window", "2046,0"]) == 0  # the last row loses its first key
    assert json.loads(capsys.readouterr().out)["params"]["window_size"] == [2046, 0]


def test_explain_takes_a_packed_batchs_lengths_and_reads_its_fills_as_the_module_does(capsys):
    from attn_dispatch.params import packed_fills, packed_window_fill

    lengths = (3968, 23, 40, 80, 120, 200, 300, 450, 25, 60)
    args = ["explain", "--platform", "h200-cudnn9", "--format", "thd", "--mask", "padding_causal", "--window",
            "640,0", "--heads", "8", "--kv-heads", "1", "--head-dim", "96", "--inference", "--json",
            "--seqlens", ",".join(map(str, lengths))]
    assert main(args) == 0
    params = json.loads(capsys.readouterr().out)["params"]
    assert params["batch_size"] == len(lengths) and params["max_seqlen_q"] == 3968
    fill, tokens = packed_fills(lengths, lengths, 3968, 3968, "padding_causal")
    windowed = packed_window_fill(lengths, lengths, 3968, 3968, "padding_causal", (640, 0))
    found = (params["packed_fill"], params["packed_token_fill"], params["packed_window_fill"])
    assert found == (fill, tokens, windowed)
    for bad, named in ((["--format", "bshd"], "--format thd"), (["--batch", "3"], "--batch 3"),
                       (["--seqlen", "1000"], "--seqlen 1000")):
        assert main(args + bad) == 2 and named in capsys.readouterr().err
