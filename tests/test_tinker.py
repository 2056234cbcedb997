"""`distflow serve tinker`, driven by the official Tinker SDK (tinker.ServiceClient) unchanged.

The server runs in this process (a thread), so a test can read the served model's gradients; the
real entry point, `distflow serve tinker CONFIG`, is tests/test_tinker_cli.py's.
"""

import copy
import math
import warnings

import pytest
import torch

tinker = pytest.importorskip("tinker", reason="the Tinker SDK is not installed: pip install 'distflow[tinker]'")
from conftest import REPO  # noqa: E402
from test_e2e import TINY  # noqa: E402
from tinker import types  # noqa: E402

from distflow.algorithms.losses import ppo_clip_loss  # noqa: E402
from distflow.config import load_config  # noqa: E402
from distflow.serve.tinker.command import checkpoint_dir  # noqa: E402
from distflow.serve.tinker.server import TinkerServer  # noqa: E402
from distflow.serve.tinker.state import EMBEDDED_NAME, build_state  # noqa: E402

# As test_e2e.py's runs (the same warm-start cache key, so one build serves both).
OVERRIDES = [*TINY, "warmstart.target_accuracy=0.02", "warmstart.check_every=20"]
MAX_REQUEST_BYTES = 256 << 10


def served(tmp_path_factory, cache_dir):
    """A server in this process on the embedded model, closed after the module's tests (its fixture)."""
    out = tmp_path_factory.mktemp("tinker")
    config = load_config(
        str(REPO / "examples/arith_grpo.yaml"),
        [*OVERRIDES, f"warmstart.cache_dir={cache_dir}", f"trainer.output_dir={out}"],
    )
    running = TinkerServer(
        build_state(config, checkpoint_dir(config), log=lambda _: None), max_request_bytes=MAX_REQUEST_BYTES
    )
    yield running.start()
    running.close()


def connected(server):
    """An SDK client of `server`, closed after the module's tests (its fixture)."""
    client = tinker.ServiceClient(base_url=server.url, api_key=server.token)
    yield client
    client.close("success").result()


server = pytest.fixture(scope="module", name="server")(served)
service = pytest.fixture(scope="module", name="service")(connected)


def datum(server, text: str, **inputs) -> types.Datum:
    """`text` as a next-token datum: input tokens[:-1], targets tokens[1:] (and `inputs`, one value per position)."""
    ids = server.state.tokenizer.encode(text)
    loss_inputs = {"target_tokens": ids[1:], **{k: v(len(ids) - 1) for k, v in inputs.items()}}
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=loss_inputs)


def sft_batch(server) -> list[types.Datum]:
    return [datum(server, text, weights=lambda n: [1.0] * n) for text in ("12+34=46", "7+8=15", "50+25=75")]


@pytest.mark.slow  # ~50 s: CI runs it (the default suite trains full-parameter and LoRA calls below)
def test_loss_falls_under_lora(server, service):
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()
    assert training.get_info().is_lora and training.get_info().lora_rank == 4
    losses = []
    for _ in range(5):
        result = training.forward_backward(sft_batch(server), "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(result.result().metrics["loss:sum"])
    # Adam on one batch need not fall at every step (at 2e-2 it once went 98, 74, 64, 76, 63 on another
    # machine's warm-start): every step below the first, and the last well below it.
    assert losses[-1] < 0.9 * losses[0] and all(later < losses[0] for later in losses[1:]), losses


def test_lora_models_share_the_one_frozen_base_and_train_only_their_own_adapters(server, service):
    """N adapters cost one base: every LoRA model's base weights are the base's own tensors, which a
    model's training leaves as they were, and one model's steps change no other's outputs."""
    base = server.state.base
    before = {name: p.detach().clone() for name, p in base.named_parameters()}
    first, second = (service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result() for _ in "ab")
    modules = [server.state.models[client.model_id].module for client in (first, second)]
    base_tensors = {p.data_ptr() for p in base.parameters()}
    for module in modules:
        frozen = [p for p in module.parameters() if not p.requires_grad]
        assert frozen and all(p.data_ptr() in base_tensors for p in frozen)
        assert all(p.data_ptr() not in base_tensors for p in module.parameters() if p.requires_grad)
    ids = torch.tensor([server.state.tokenizer.encode("12+34=46")])
    with torch.no_grad():
        second_before = modules[1](input_ids=ids).logits
    for _ in range(2):
        first.forward_backward(sft_batch(server), "cross_entropy").result()
        first.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert all(torch.equal(p, before[name]) for name, p in base.named_parameters())
    with torch.no_grad():
        assert torch.equal(modules[1](input_ids=ids).logits, second_before)
        assert not torch.equal(modules[0](input_ids=ids).logits, second_before)


def _direct_grads(module, data, loss_fn: str, config: dict) -> tuple[float, dict]:
    """The batch's summed loss and its gradient, computed here: log_softmax of the logits, then
    distflow's own loss (ppo_clip_loss; cross-entropy -Σ w·logp)."""
    total = 0.0
    for d in data:
        ids = torch.tensor([d.model_input.to_ints()])
        inputs = {k: v.to_torch() for k, v in d.loss_fn_inputs.items()}
        logp_T = torch.log_softmax(module(input_ids=ids).logits[0].float(), -1)
        logp_T = logp_T.gather(-1, inputs["target_tokens"].long().unsqueeze(-1)).squeeze(-1)
        if loss_fn == "cross_entropy":
            loss = -(inputs["weights"] * logp_T).sum()
        else:
            low, high = (math.inf, math.inf)
            if loss_fn == "ppo":
                low, high = 1 - config["clip_low_threshold"], config["clip_high_threshold"] - 1
            loss_BR, _ = ppo_clip_loss(
                logp_T[None], inputs["logprobs"][None], inputs["advantages"][None], clip_low=low, clip_high=high
            )
            loss = loss_BR.sum()
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad for n, p in module.named_parameters() if p.requires_grad}


def _rl_batch(server) -> list[types.Datum]:
    generator = torch.Generator().manual_seed(0)
    return [
        datum(
            server,
            text,
            logprobs=lambda n: (-2.0 + 0.5 * torch.randn(n, generator=generator)).tolist(),
            advantages=lambda n: torch.randn(n, generator=generator).tolist(),
        )
        for text in ("3+4=7", "21+13=34")
    ]


@pytest.mark.parametrize(
    ("loss_fn", "rank"), [("cross_entropy", 0), ("importance_sampling", 0), ("ppo", 0), ("importance_sampling", 4)]
)
def test_forward_backward_gradients_equal_a_direct_computation(server, service, loss_fn, rank):
    """The gradient of every trained weight (rank 0: all of them; LoRA: the adapters'), float32, 1e-6 relative."""
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=rank).result()
    served = server.state.models[training.model_id]
    before = copy.deepcopy(served.module)
    data = sft_batch(server) if loss_fn == "cross_entropy" else _rl_batch(server)
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1} if loss_fn == "ppo" else None
    result = training.forward_backward(data, loss_fn, config).result()
    direct_loss, direct = _direct_grads(before, data, loss_fn, config or {})
    # A sum of per-token terms of either sign (advantages ~ N(0, 1)) can nearly cancel: its rounding is to
    # the terms' scale, one per target token, not to the sum's (an AVX2 CPU: -0.1489445 against -0.1489443).
    num_targets = sum(len(d.loss_fn_inputs["target_tokens"].tolist()) for d in data)
    assert result.metrics["loss:sum"] == pytest.approx(direct_loss, rel=1e-6, abs=1e-6 * num_targets)
    grads = {n: p.grad for n, p in served.module.named_parameters() if p.requires_grad}
    assert set(grads) == set(direct) and len(grads) > 10
    served_BG, direct_BG = (torch.cat([g[n].reshape(-1) for n in sorted(direct)]) for g in (grads, direct))
    assert float(direct_BG.norm()) > 0
    assert float((served_BG - direct_BG).norm() / direct_BG.norm()) < 1e-6
    assert len(result.loss_fn_outputs) == len(data)
    assert all(
        len(o["logprobs"].tolist()) == d.model_input.length for o, d in zip(result.loss_fn_outputs, data, strict=True)
    )


def _step(training, data) -> float:
    loss = training.forward_backward(data, "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-2, weight_decay=0.01)).result()
    return loss.result().metrics["loss:sum"]


def test_save_state_and_load_state_resume_to_the_same_next_losses(server, service):
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()
    data = sft_batch(server)
    _step(training, data)
    _step(training, data)
    path = training.save_state("after-two").result().path
    assert path == f"tinker://{training.model_id}/weights/after-two"
    expected = [_step(training, data), _step(training, data)]
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert [_step(resumed, data), _step(resumed, data)] == pytest.approx(expected, rel=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # load_state is deprecated in the SDK, still served
        training.load_state_with_optimizer(path).result()
    assert _step(training, data) == pytest.approx(expected[0], rel=1e-6)


def test_sample_returns_the_log_probs_training_computes(server, service):
    """Sampled tokens' log-probs (temperature 1) are what forward computes for them; a seed repeats a draw."""
    sampler = service.create_sampling_client(base_model=EMBEDDED_NAME).result()
    prompt = types.ModelInput.from_ints(server.state.tokenizer.encode("12+34="))
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    first = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(first.sequences) == 3
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=0).result()  # base weights
    for seq in first.sequences:
        assert 1 <= len(seq.tokens) <= 4 and len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason in ("stop", "length")
        full = prompt.to_ints() + seq.tokens
        forward = training.forward(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]}
                )
            ],
            "cross_entropy",
        ).result()
        computed = forward.loss_fn_outputs[0]["logprobs"].tolist()[-len(seq.tokens) :]
        assert computed == pytest.approx(seq.logprobs, abs=1e-4)


def test_a_sampling_client_of_trained_weights(server, service):
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()
    _step(training, sft_batch(server))
    path = training.save_weights_for_sampler("trained").result().path
    assert path.endswith("/sampler_weights/trained")
    prompt = types.ModelInput.from_ints(server.state.tokenizer.encode("7+8="))
    for made in (service.create_sampling_client(model_path=path), training.save_weights_and_get_sampling_client()):
        sampler = made.result()
        result = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=3)).result()
        assert len(result.sequences) == 2 and all(all(lp <= 0 for lp in s.logprobs) for s in result.sequences)


# Hostile cases: each gets one clear error, in the SDK's own exception types, and the server goes on.


def test_a_wrong_api_key_is_the_sdks_authentication_error(server):
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-not-this-servers-key")
    with pytest.raises(tinker.AuthenticationError, match="invalid API key"):
        client.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()


def test_an_unknown_base_model_is_refused_by_name(service):
    with pytest.raises(tinker.RequestFailedError, match="unknown base_model 'Qwen/Qwen3-8B'.*distflow/embedded"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()


def test_an_unknown_model_id_is_refused_by_name(server, service):
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()
    training.model_id = "no-such-session:train:7"
    with pytest.raises(tinker.RequestFailedError, match="unknown model_id 'no-such-session:train:7'") as caught:
        training.forward_backward(sft_batch(server), "cross_entropy").result()
    assert caught.value.category == types.RequestErrorCategory.User


def test_optim_step_before_any_forward_backward_says_so(service):
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="optim_step .* before any forward_backward"):
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_a_resent_step_runs_once_and_gets_the_first_ones_request_id(server, service):
    """The SDK resends a request whose reply a reset connection lost, with the same seq_id: the server queues it
    once (a second optim_step would step twice), and a new seq_id is a new request."""
    import json
    import urllib.request

    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()
    training.forward_backward(sft_batch(server), "cross_entropy").result()

    def post(seq_id: int) -> str:
        body = {"model_id": training.model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 1e-3}}
        request = urllib.request.Request(
            server.url + "/api/v1/optim_step", data=json.dumps(body).encode(), method="POST",
            headers={"X-API-Key": server.token, "Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=1800) as reply:
            return json.loads(reply.read())["request_id"]

    first = post(1000)
    assert post(1000) == first
    assert server.futures.retrieve(first, wait=1800).error is None  # the one step, on forward_backward's gradients
    second = server.futures.retrieve(post(1001), wait=1800)  # a new step: no gradients left to step on
    assert "before any forward_backward" in second.error


def test_an_oversize_request_is_refused_before_it_is_read(server, service):
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()
    num = MAX_REQUEST_BYTES // 8  # 16 bytes a position on the wire (int32 token, int64 target, float32 weight)
    big = types.Datum(
        model_input=types.ModelInput.from_ints([1] * num),
        loss_fn_inputs={"target_tokens": [1] * num, "weights": [1.0] * num},
    )
    with pytest.raises(tinker.APIStatusError, match="over this server's limit") as caught:
        training.forward_backward([big], "cross_entropy").result()
    assert caught.value.status_code == 413


def test_a_bad_loss_or_its_missing_inputs_are_named(server, service):
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match=r"loss 'ppo' needs loss_fn_inputs\['logprobs'\]"):
        training.forward_backward(sft_batch(server), "ppo").result()
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="loss_fn 'cispo' is not served; served: cross_entropy"):
        training.forward_backward(sft_batch(server), "cispo").result()
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()
    assert training.forward_backward(sft_batch(server), "cross_entropy").result().metrics["loss:sum"] > 0


def test_forward_backward_custom_runs_client_side_over_cross_entropy(server, service):
    """The SDK's forward_backward_custom: forward, the loss's gradient on the client, then cross_entropy with
    weights = -dC/dlogp. C = -Σ logp has the gradient of cross_entropy with weights 1."""
    grads = []
    for custom in (False, True):
        training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=0).result()
        if custom:
            training.forward_backward_custom(
                sft_batch(server), lambda data, logprobs: (-sum(lp.sum() for lp in logprobs), {})
            ).result()
        else:
            training.forward_backward(sft_batch(server), "cross_entropy").result()
        module = server.state.models[training.model_id].module
        grads.append(torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.requires_grad]))
    assert float((grads[0] - grads[1]).norm() / grads[0].norm()) < 1e-6


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/api/v1/create_session", b"{not json", 400, "the body is not JSON"),
        ("/api/v1/forward_backward", b"\xff\xfe garbage", 400, "not a ForwardBackwardRequest protobuf"),
        ("/api/v1/retrieve_future", b'{"request_id": "req-999999"}', 404, "unknown request_id 'req-999999'"),
        ("/api/v1/get_info", b'{"model_id": 3}', 404, "unknown model_id 3"),
        ("/api/v1/no_such_route", b"{}", 404, "is not served by distflow's Tinker server"),
    ],
)
def test_raw_hostile_requests_get_one_line_errors(server, path, body, status, message):
    """Below the SDK: malformed bodies and unknown routes are 4xx with {"detail": ...}, never a traceback."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(server.url + path, data=body, headers={"X-API-Key": server.token}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=1800)
    assert caught.value.code == status
    detail = json.loads(caught.value.read())["detail"]
    assert message in detail and "Traceback" not in detail


def test_the_sdks_get_tokenizer_loads_the_served_models_tokenizer(server, service):
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()
    assert training.get_tokenizer().encode("12+34=46") == server.state.tokenizer.encode("12+34=46")


def test_a_lora_rank_above_the_models_dimensions_is_refused_by_name(service):
    with pytest.raises(
        tinker.RequestFailedError, match="LoRA rank 100000 is refused: .*exceeds the smallest dimension"
    ):
        service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=100000).result()


def test_a_stop_string_ends_a_sample_at_the_token_that_completes_it(server, service):
    """Greedy, so every call draws the same tokens: a stop string cuts them where its text first appears."""
    sampler = service.create_sampling_client(base_model=EMBEDDED_NAME).result()
    prompt = types.ModelInput.from_ints(server.state.tokenizer.encode("12+34="))

    def draw(stop) -> types.SampledSequence:
        params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=stop)
        return sampler.sample(prompt, num_samples=2, sampling_params=params).result().sequences[0]

    free = draw([])
    assert len(free.tokens) == 6 and free.stop_reason == "length"
    second = server.state.tokenizer.decode(free.tokens[1:2])
    cut = draw(second)  # a string: the first token whose completion text holds it ends the sample
    end = next(k for k in range(1, 7) if second in server.state.tokenizer.decode(free.tokens[:k]))
    assert (cut.tokens, cut.stop_reason) == (free.tokens[:end], "stop")
    assert cut.logprobs == pytest.approx(free.logprobs[:end], abs=1e-6)
    assert draw(["no such text"]).tokens == free.tokens


def test_the_server_names_the_settings_it_does_not_use():
    """A setting of distflow train given to `serve tinker` is said, in one line, not ignored silently: the
    client sends its own losses, AdamParams and SamplingParams, and the server computes in float32."""
    from distflow.serve.tinker.command import UNREAD, unread_settings

    assert unread_settings(load_config(None, [])) == []
    given = load_config(None, ["parallel.param_dtype=bfloat16", "optim.lr=0.1", "rollout.temperature=0.5"])
    assert unread_settings(given) == ["optim.lr", "parallel.param_dtype"]  # the embedded warm-start reads the rest
    real = load_config(None, ["model.path=/models/x", "rollout.temperature=0.5", "model.lora.rank=8"])
    assert unread_settings(real) == ["rollout.temperature"]  # model.* is the server's; no warm-start to key
    line = UNREAD.format(keys=", ".join(unread_settings(given)))
    assert "\n" not in line and line.startswith("distflow serve tinker: not used here") and "optim.lr" in line
