"""LoRA serving in the embedded engine over real HTTP, SGLang's API, against HF + PEFT.

* greedy tokens (and log-probs) under an adapter equal `peft.PeftModel`'s on the same base;
  a request without `lora_path` is served by the base;
* a corrupted, wrong-shape, too-high-rank or pickled adapter is refused (400; a wrong header
  before any tensor is read) and the adapter
  already loaded keeps serving; `/load_lora_adapter_from_tensors` is refused;
* an adapter a request names cannot be unloaded while it runs; unknown names are 400;
* LoRA routes need the token on an engine that has one (401 without), the distributed adapter
  push's bucket calls and activation included;
* a versioned push (`weight_version`) across an in-flight request: each token's log-prob is the
  one of the adapter its version span names.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch

from slime_async.contracts.model import ModelSpec
from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.testing import post

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(180)

SPEC = ModelSpec(family="llama", num_layers=2, vocab_size=512)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 42, 9, 300, 77]


def _base(d: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(SPEC.to_hf_config(), dtype=torch.float32)
    model.save_pretrained(str(d))
    return d


def _adapter(base: Path, d: Path, *, seed: int, rank: int = 4, targets=TARGETS) -> Path:
    """A PEFT adapter with random A and B (written by peft itself)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets))
    pm = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(str(d))
    return d


def _peft_model(base: Path, adapter: Path | None):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is None:
        return model.eval()
    return peft.PeftModel.from_pretrained(model, str(adapter)).eval()


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _token_logprobs(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(out) - 1)
    return lp[pos, torch.tensor(out)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("lora")
    base = _base(d / "base")
    a1 = _adapter(base, d / "a1", seed=1)
    a2 = _adapter(base, d / "a2", seed=2)
    cfg = EngineConfig(model_dir=str(base), dtype="fp32", enable_lora=True, weight_version="0")
    srv = EngineServer(cfg)
    url = srv.start()
    yield url, base, a1, a2, d
    srv.stop()


def _gen(n: int = 12, **extra):
    return {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        **extra,
    }


async def test_adapter_greedy_tokens_equal_hf_peft(setup):
    url, base, a1, _, _ = setup
    async with aiohttp.ClientSession() as s:
        st, res = await post(
            s, url + "/load_lora_adapter", {"lora_name": "a1", "lora_path": str(a1)}
        )
        assert st == 200 and res["success"] and res["loaded_adapters"] == {"a1": str(a1)}, res
        _, with_a = await post(s, url + "/generate", _gen(lora_path="a1"))
        _, plain = await post(s, url + "/generate", _gen())
        # a batch mixing the adapter and the base: each row as if alone
        _, mixed = await post(
            s,
            url + "/generate",
            {**_gen(), "input_ids": [PROMPT, PROMPT], "lora_path": ["a1", None]},
        )
    want = _greedy(_peft_model(base, a1), PROMPT, 12)
    want_base = _greedy(_peft_model(base, None), PROMPT, 12)
    assert want != want_base  # the adapter changes the policy
    assert with_a["output_ids"] == want
    assert plain["output_ids"] == want_base
    assert [m["output_ids"] for m in mixed] == [want, want_base]
    lps = torch.tensor([t[0] for t in with_a["meta_info"]["output_token_logprobs"]])
    ref = _token_logprobs(_peft_model(base, a1), PROMPT, want)
    assert (lps - ref).abs().max() < 1e-4


async def test_bad_adapters_refused_old_keeps_serving(setup):
    url, base, a1, _, d = setup
    wrong = _adapter(base, d / "wrong_rank", seed=3, rank=8)  # loads, but a rank-8 replacement
    corrupt = d / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((a1 / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    shaped = d / "shaped"
    shaped.mkdir()
    from safetensors.torch import load_file, save_file

    t = load_file(str(a1 / "adapter_model.safetensors"))
    key = sorted(k for k in t if "lora_A" in k)[0]
    t[key] = torch.zeros(4, 7)
    save_file(t, str(shaped / "adapter_model.safetensors"))
    (shaped / "adapter_config.json").write_text((a1 / "adapter_config.json").read_text())
    nan = d / "nan"
    nan.mkdir()
    t = load_file(str(a1 / "adapter_model.safetensors"))
    t[key] = torch.full_like(t[key], float("nan"))
    save_file(t, str(nan / "adapter_model.safetensors"))
    (nan / "adapter_config.json").write_text((a1 / "adapter_config.json").read_text())
    pickled = d / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((a1 / "adapter_config.json").read_text())
    torch.save({}, pickled / "adapter_model.bin")
    async with aiohttp.ClientSession() as s:
        await post(s, url + "/load_lora_adapter", {"lora_name": "a1", "lora_path": str(a1)})
        _, before = await post(s, url + "/generate", _gen(lora_path="a1"))
        for bad, why in [
            (corrupt, "safetensors"),
            (shaped, "shape"),
            (nan, "non-finite"),
            (pickled, "never read"),
        ]:
            body = {"lora_name": "a1", "lora_path": str(bad), "weight_version": "9"}
            st, res = await post(s, url + "/load_lora_adapter", body)
            assert st == 400 and not res["success"] and why in res["error_message"], res
        st, res = await post(
            s, url + "/load_lora_adapter", {"lora_name": "a1", "lora_path": str(wrong)}
        )
        assert st == 400 and "already loaded" in res["error_message"]
        st, _ = await post(s, url + "/load_lora_adapter_from_tensors", {"lora_name": "x"})
        assert st == 400
        _, after = await post(s, url + "/generate", _gen(lora_path="a1"))
        st, res = await post(s, url + "/generate", _gen(lora_path="nope"))
        assert st == 400 and "no loaded adapter" in res["error"]["message"]
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]


async def test_a_wrong_adapter_is_refused_from_its_header_before_a_tensor_is_read(
    setup, monkeypatch
):
    """Wrong shapes, an unexpected tensor, a rank above the engine's limit: each refused from
    the safetensors header and adapter_config.json, with not one tensor read (the engine runs
    in this process: the library's reads are counted)."""
    import safetensors
    from safetensors.torch import load_file, save_file

    url, base, a1, _, d = setup
    reads: list[str] = []
    real_open = safetensors.safe_open

    class Counting:
        def __init__(self, *a, **kw):
            self._h = real_open(*a, **kw)

        def __enter__(self):
            self._h.__enter__()
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def get_tensor(self, k):
            reads.append(k)
            return self._h.get_tensor(k)

        def __getattr__(self, name):
            return getattr(self._h, name)

    t = load_file(str(a1 / "adapter_model.safetensors"))
    key = sorted(k for k in t if "lora_A" in k)[0]
    cases = {
        "shape": {**t, key: torch.zeros(4, 7)},
        "unexpected": {**t, "base_model.model.model.layers.0.mlp.extra.lora_A.weight": t[key] + 0},
    }
    high = _adapter(base, d / "rank_above_max", seed=4, rank=128)  # the engine's max: 64
    monkeypatch.setattr(safetensors, "safe_open", Counting)
    async with aiohttp.ClientSession() as s:
        for why, tensors in cases.items():
            bad = d / f"header_{why}"
            bad.mkdir(exist_ok=True)
            save_file(tensors, str(bad / "adapter_model.safetensors"))
            (bad / "adapter_config.json").write_text((a1 / "adapter_config.json").read_text())
            body = {"lora_name": f"h_{why}", "lora_path": str(bad)}
            st, res = await post(s, url + "/load_lora_adapter", body)
            assert st == 400 and why in res["error_message"], res
        st, res = await post(
            s, url + "/load_lora_adapter", {"lora_name": "h", "lora_path": str(high)}
        )
        assert st == 400 and "max LoRA rank" in res["error_message"], res
    assert reads == []


async def _wait_tokens(s: aiohttp.ClientSession, url: str, n: int) -> None:
    for _ in range(400):
        async with s.get(url + "/server_info") as r:
            info = await r.json()
        if info["internal_states"][0]["num_tokens"] >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("generation did not progress")


async def test_unload_refused_while_in_use(setup):
    url, _, a1, _, _ = setup
    async with aiohttp.ClientSession() as s:
        await post(s, url + "/load_lora_adapter", {"lora_name": "u", "lora_path": str(a1)})
        running = asyncio.ensure_future(post(s, url + "/generate", _gen(400, lora_path="u")))
        await _wait_tokens(s, url, 10)
        st, res = await post(s, url + "/unload_lora_adapter", {"lora_name": "u"})
        assert st == 400 and "requests in the engine" in res["error_message"], res
        st, done = await running
        assert st == 200 and len(done["output_ids"]) == 400
        st, res = await post(s, url + "/unload_lora_adapter", {"lora_name": "u"})
        assert st == 200 and "u" not in res["loaded_adapters"]
        st, _ = await post(s, url + "/unload_lora_adapter", {"lora_name": "u"})
        assert st == 400


async def test_versioned_push_per_token_versions(setup):
    """Pause in place, push adapter a2 as version 1 under the same name, continue: the tokens
    before the span boundary have a1's log-probs, those after it a2's."""
    url, base, a1, a2, _ = setup
    n = 60
    async with aiohttp.ClientSession() as s:
        body = {"lora_name": "policy", "lora_path": str(a1), "weight_version": "0"}
        st, res = await post(s, url + "/load_lora_adapter", body)
        assert st == 200, res
        inflight = asyncio.ensure_future(post(s, url + "/generate", _gen(n, lora_path="policy")))
        await _wait_tokens(s, url, 10)
        await post(s, url + "/pause_generation", {"mode": "in_place"})
        body = {"lora_name": "policy", "lora_path": str(a2), "weight_version": "1"}
        st, res = await post(s, url + "/load_lora_adapter", body)
        await post(s, url + "/continue_generation", {})
        assert st == 200 and res["success"], res
        _, crossing = await inflight
    spans = crossing["meta_info"]["weight_versions"]
    assert [sp["version"] for sp in spans] == ["0", "1"]
    cut = spans[0]["end"]
    assert 0 < cut < n == spans[1]["end"]
    out = crossing["output_ids"]
    got = torch.tensor([t[0] for t in crossing["meta_info"]["output_token_logprobs"]])
    # what served each token: a1 up to the cut; then a2, over the KV cache a1 wrote (in place)
    want = _switched_logprobs(base, a1, a2, PROMPT, out, cut)
    assert (got - want).abs().max() < 1e-4
    lp1 = _token_logprobs(_peft_model(base, a1), PROMPT, out)
    assert (lp1[cut:] - want[cut:]).abs().max() > 1e-2  # the two adapters differ: teeth


def _switched_logprobs(base, a1, a2, prompt, out, cut) -> torch.Tensor:
    """HF + PEFT log-probs of `out` when adapter a1 forwards prompt + out[:cut - 1] (the tokens
    sampled before the push: their distributions come from a1) and a2 forwards the rest on
    top of a1's KV cache."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(model, str(a1), adapter_name="a1").eval()
    pm.load_adapter(str(a2), adapter_name="a2")
    ids = prompt + out
    first = len(prompt) + cut - 1
    with torch.no_grad():
        pm.set_adapter("a1")
        o1 = pm(input_ids=torch.tensor([ids[:first]]), use_cache=True)
        pm.set_adapter("a2")
        o2 = pm(input_ids=torch.tensor([ids[first:]]), past_key_values=o1.past_key_values)
    logits = torch.cat([o1.logits[0], o2.logits[0]], 0).float()
    lp = torch.log_softmax(logits, -1)
    pos = torch.arange(len(prompt) - 1, len(ids) - 1)
    return lp[pos, torch.tensor(out)]


async def test_lora_routes_need_the_token(setup, tmp_path):
    _, base, a1, _, _ = setup
    cfg = EngineConfig(model_dir=str(base), dtype="fp32", enable_lora=True, api_key="s3cret")
    srv = EngineServer(cfg)
    url = srv.start()
    try:
        async with aiohttp.ClientSession() as s:
            body = {"lora_name": "a1", "lora_path": str(a1)}
            st, _ = await post(s, url + "/load_lora_adapter", body)
            assert st == 401
            st, _ = await post(s, url + "/unload_lora_adapter", {"lora_name": "a1"})
            assert st == 401
            # the distributed adapter push: its bucket calls and its activation
            bucket = {
                "names": ["x"],
                "dtypes": ["float32"],
                "shapes": [[1]],
                "lora_name": "policy",
                "lora_config": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
            }
            st, res = await post(s, url + "/update_weights_from_distributed", bucket)
            assert st == 401 and res["received"] is False
            activate = {"lora_name": "policy", "weight_version": "1", "from_distributed": True}
            st, _ = await post(s, url + "/load_lora_adapter", activate)
            assert st == 401
        headers = {"Authorization": "Bearer s3cret"}
        async with aiohttp.ClientSession(headers=headers) as s:
            st, res = await post(s, url + "/load_lora_adapter", body)
            assert st == 200 and res["success"]
            st, res = await post(s, url + "/load_lora_adapter", activate)  # nothing received
            assert st == 400 and "received" in res["error_message"]
            no_cfg = {k: v for k, v in bucket.items() if k != "lora_config"}
            st, res = await post(s, url + "/update_weights_from_distributed", no_cfg)
            assert st == 400 and res["received"] is False and "lora_config" in res["message"]
    finally:
        srv.stop()


def test_sglang_launcher_passes_the_lora_flags():
    from slime_async.contracts.engine import EngineLaunch
    from slime_async.engine.sglang import build_command
    from slime_async.orchestrator.engines.sglang import sglang_config

    eng = EngineConfig(enable_lora=True, max_lora_rank=16, lora_target_modules=("q_proj", "v_proj"))
    launch = EngineLaunch(index=0, model_dir="/ckpt", weight_version=0, seed=1)
    cmd = build_command(sglang_config(eng, launch, port=30000))
    assert "--enable-lora" in cmd
    i = cmd.index("--lora-target-modules")
    assert cmd[i + 1 : i + 3] == ["q_proj", "v_proj"]
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16"
    assert cmd[cmd.index("--max-loaded-loras") + 1] == "4"
    plain = build_command(sglang_config(EngineConfig(), launch, port=30000))
    assert not any("lora" in a for a in plain)


async def test_client_refuses_a_request_without_the_adapter():
    """In a LoRA run the rollout client never lets the base model answer silently."""
    from slime_async.rollout.generate.client import (
        GenerateClient,
        GenerateClientConfig,
        GenerateError,
    )

    client = GenerateClient(GenerateClientConfig(url="http://127.0.0.1:9", lora_name="policy"))
    try:
        for body in ({"input_ids": [1]}, {"input_ids": [1], "lora_path": "other"}):
            with pytest.raises(GenerateError, match="LoRA run"):
                await client.post(body, {})
    finally:
        await client.close()


async def test_prefix_cache_never_crosses_adapters_or_their_versions(setup):
    """KV computed under one adapter is not reused under another (or the base), nor after a
    versioned push replaced the adapter: a request after the push has 0 cached tokens and
    the new adapter's greedy tokens."""
    url, base, a1, a2, _ = setup
    long = PROMPT * 4

    def body(**extra):
        return {**_gen(4), "input_ids": long, **extra}

    async with aiohttp.ClientSession() as s:
        load = {"lora_name": "cached", "lora_path": str(a1), "weight_version": "0"}
        assert (await post(s, url + "/load_lora_adapter", load))[0] == 200
        _, first = await post(s, url + "/generate", body(lora_path="cached"))
        _, again = await post(s, url + "/generate", body(lora_path="cached"))
        _, on_base = await post(s, url + "/generate", body())
        await post(s, url + "/pause_generation", {"mode": "in_place"})
        load = {"lora_name": "cached", "lora_path": str(a2), "weight_version": "1"}
        st, res = await post(s, url + "/load_lora_adapter", load)
        await post(s, url + "/continue_generation", {})
        assert st == 200 and res["success"], res
        _, after = await post(s, url + "/generate", body(lora_path="cached"))
    assert again["meta_info"]["cached_tokens"] == len(long) - 1  # the cache works
    assert on_base["meta_info"]["cached_tokens"] == 0  # the base never reads adapter KV
    assert after["meta_info"]["cached_tokens"] == 0  # nor the new version the old one's
    assert after["output_ids"] == _greedy(_peft_model(base, a2), long, 4)
    assert first["output_ids"] == _greedy(_peft_model(base, a1), long, 4)
