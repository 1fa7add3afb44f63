"""Flags generated from config fields: every setting declared once, every existing flag name kept, the
pods' defaults unchanged, and a new field becomes a flag by itself."""
import argparse
import dataclasses
from dataclasses import dataclass, field

import pytest

from decode_svc.flags import build_arg_parser as decode_parser, pod_config as decode_config, prefill_client_config
from prefill_svc.flags import build_arg_parser as prefill_parser, pod_config as prefill_config
from router.flags import RouterConfig, build_arg_parser as router_parser
from shared.engine.kv_transfer.connector import KVLoadFailurePolicy
from shared.serving.server.api_auth import ApiAuthConfig
from shared.serving.server.handle_key import HandleKeyConfig
from shared.serving.pod.runtime import PodConfig
from shared.serving.server.settings import add_flags, config_from_args, setting
from shared.serving.server.tls import TlsConfig

POD_FLAGS = [
    "--host", "--port", "--metrics-port", "--otlp-endpoint", "--otel-sampling-ratio", "--model", "--dtype", "--seed",
    "--generation-config",
    "--block-size", "--num-blocks", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
    "--no-prefix-caching", "--device", "--num-threads", "--max-requests-in-flight", "--grace-seconds",
    "--enforce-eager", "--override-generation-config",
]
ROUTER_FLAGS = [
    "--host", "--port", "--prefill", "--decode", "--policy", "--metrics-port", "--otlp-endpoint", "--tokenizer",
    "--max-prefill-retries", "--max-decode-retries", "--health-interval", "--resolve-interval", "--request-timeout",
    "--grace-seconds",
]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def test_every_existing_flag_name_is_kept_and_roles_get_only_their_own():
    prefill, decode = _flags(prefill_parser()), _flags(decode_parser())
    assert set(POD_FLAGS) <= prefill and set(POD_FLAGS) <= decode
    assert {"--lease-s", "--advertise-address"} <= prefill and "--kv-load-failure-policy" not in prefill
    assert "--kv-load-failure-policy" in decode and "--lease-s" not in decode
    assert set(ROUTER_FLAGS) <= _flags(router_parser())


def test_the_pods_defaults_are_the_serving_defaults():
    config = prefill_config(prefill_parser().parse_args([]))
    assert config == PodConfig()
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (128, 4096)
    assert (config.max_model_len, config.cache.block_size, config.cache.num_blocks) == (None, 16, 4096)
    assert config.cache.enable_prefix_caching and config.num_threads is None


def test_flags_land_in_the_composed_configs():
    args = decode_parser().parse_args([
        "--num-blocks", "64", "--max-num-batched-tokens", "512", "--max-model-len", "300", "--no-prefix-caching",
        "--kv-load-failure-policy", "fail", "--num-threads", "2", "--prefill-rpc-timeout", "1.5",
        "--enforce-eager",
    ])
    config = decode_config(args)
    assert config.enforce_eager and not PodConfig().enforce_eager
    assert (config.cache.num_blocks, config.cache.enable_prefix_caching) == (64, False)
    assert (config.scheduler.max_num_batched_tokens, config.max_model_len) == (512, 300)
    assert config.scheduler.max_num_seqs == 128  # untouched settings keep the serving default
    assert config.kv_load_failure_policy is KVLoadFailurePolicy.FAIL and config.num_threads == 2
    assert prefill_client_config(args).prefill_rpc_timeout_s == 1.5
    with pytest.raises(ValueError, match="num_blocks"):
        decode_config(decode_parser().parse_args(["--num-blocks", "1"]))


def test_generation_config_takes_a_folder_and_overrides_as_vllms_flags(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3}')
    args = prefill_parser().parse_args(["--generation-config", str(tmp_path),
                                        "--override-generation-config", '{"top_k": 5, "do_sample": true}'])
    config = prefill_config(args)
    assert config.generation_config == str(tmp_path)
    assert config.generation_overrides == {"top_k": 5, "do_sample": True}
    for flags, refusal in [
        (["--generation-config", str(tmp_path / "nowhere")], "a folder holding a generation_config.json"),
        (["--override-generation-config", '{"typical_p": 0.9}'], "typical_p cannot be set"),
        (["--override-generation-config", '{"top_p": 0}'], "top_p must be in"),
        (["--override-generation-config", "temperature=0.5"], "not JSON"),
    ]:
        with pytest.raises(ValueError, match=refusal):
            prefill_config(prefill_parser().parse_args(flags))


def test_router_flags_build_one_composed_config():
    args = router_parser().parse_args([
        "--prefill", "a:1", "--decode", "b:2", "--health-interval", "0.5", "--probe-timeout", "0.25",
        "--prefill-rpc-timeout", "3", "--request-timeout", "30", "--tokenizer", "",
    ])
    config = RouterConfig.from_args(args)
    pool = config.pool
    assert (pool.health_interval_s, pool.probe_timeout_s, pool.resolve_interval_s) == (0.5, 0.25, 10.0)
    assert config.prefill_client.prefill_rpc_timeout_s == 3.0
    assert (config.request_timeout_s, config.tokenizer_path) == (30.0, None)
    with pytest.raises(ValueError, match="health_interval_s"):
        RouterConfig.from_args(
            router_parser().parse_args(["--prefill", "a:1", "--decode", "b:2", "--health-interval", "0"])
        )


def test_a_new_field_is_a_new_flag():
    @dataclass(frozen=True)
    class Extended:
        drain_grace_s: float = field(default=2.0, metadata=setting("seconds to drain", flag="--drain-grace"))
        policy: KVLoadFailurePolicy = field(default=KVLoadFailurePolicy.RECOMPUTE, metadata=setting("policy"))
        not_a_flag: int = 7

    parser = argparse.ArgumentParser()
    add_flags(parser, Extended)
    assert {"--drain-grace", "--policy"} <= _flags(parser) and "--not-a-flag" not in _flags(parser)
    config = config_from_args(Extended, parser.parse_args(["--drain-grace", "4", "--policy", "fail"]))
    assert config == Extended(drain_grace_s=4.0, policy=KVLoadFailurePolicy.FAIL)
    with pytest.raises(SystemExit):
        parser.parse_args(["--policy", "sometimes"])


def test_enforce_eager_turns_the_engines_cuda_graphs_off(monkeypatch):
    """--enforce-eager reaches the engine as cuda_graphs=False; without it the engine decides (on for CUDA)."""
    import shared.serving.pod.runtime as pod_runtime

    seen = []
    real_engine = pod_runtime.LLMEngine

    def recording_engine(*args, **kwargs):
        seen.append(kwargs["cuda_graphs"])
        return real_engine(*args, **kwargs)

    monkeypatch.setattr(pod_runtime, "LLMEngine", recording_engine)
    small = dict(model="tiny", cache=dataclasses.replace(PodConfig().cache, num_blocks=256))
    pod_runtime.Pod(None, PodConfig(**small, enforce_eager=True))
    pod_runtime.Pod(None, PodConfig(**small))
    assert seen == [False, None]


def test_a_pod_fills_unset_fields_from_its_overrides():
    from shared.engine.request import SamplingParams
    from shared.serving.pod.runtime import Pod

    small = dict(model="tiny", cache=dataclasses.replace(PodConfig().cache, num_blocks=256))
    pod = Pod(None, PodConfig(**small, override_generation_config='{"temperature": 0.5, "max_new_tokens": 7}'))
    filled = pod.fill_sampling(SamplingParams(unset={"temperature", "max_tokens"}), num_prompt_tokens=10)
    assert (filled.temperature, filled.max_tokens) == (0.5, 7)


def test_tls_files_are_checked_at_start_up_and_named_by_their_flags(tmp_path):
    from certs import CertificateAuthority

    ca = CertificateAuthority(tmp_path)
    one, other = ca.issue("one"), ca.issue("other")
    assert TlsConfig(tls_cert=str(one.cert), tls_key=str(one.key), tls_ca=str(ca.cert_path)).is_enabled
    with pytest.raises(ValueError, match=f"--tls-key {other.key} is not the private key of --tls-cert {one.cert}"):
        TlsConfig(tls_cert=str(one.cert), tls_key=str(other.key))
    with pytest.raises(ValueError, match=f"--tls-key {one.cert} holds no PEM private key"):
        TlsConfig(tls_cert=str(one.cert), tls_key=str(one.cert))
    with pytest.raises(ValueError, match=f"--tls-cert {one.key} holds no readable PEM certificate"):
        TlsConfig(tls_cert=str(one.key), tls_key=str(one.key))
    with pytest.raises(ValueError, match=f"--tls-ca {one.key} holds no readable PEM certificate"):
        TlsConfig(tls_ca=str(one.key))
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(_encrypted_pem(one.key))
    with pytest.raises(ValueError, match=f"--tls-key {encrypted} is encrypted"):
        TlsConfig(tls_cert=str(one.cert), tls_key=str(encrypted))


def _encrypted_pem(key_path) -> bytes:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.BestAvailableEncryption(b"passphrase"))


def test_a_blank_api_token_in_the_environment_is_refused_not_an_open_api():
    for blank in ("", " ", "\n"):
        with pytest.raises(ValueError, match="PDSERVE_API_TOKEN is set but blank"):
            ApiAuthConfig().load({"PDSERVE_API_TOKEN": blank})
    assert ApiAuthConfig().load({"PDSERVE_API_TOKEN": " tok\n"}) == "tok"
    assert ApiAuthConfig().load({}) is None


def test_a_binary_handle_key_file_is_refused_naming_the_flag_and_the_file(tmp_path):
    binary = tmp_path / "binary.key"
    binary.write_bytes(bytes(range(256))[-64:])  # not UTF-8, as `head -c 32 /dev/urandom` mostly is
    with pytest.raises(ValueError, match=f"--kv-handle-key-file {binary} is not UTF-8 text.*openssl rand -hex 32"):
        HandleKeyConfig(kv_handle_key_file=str(binary)).load({})
    text = tmp_path / "text.key"
    text.write_text("ab" * 16 + "\n")
    assert HandleKeyConfig(kv_handle_key_file=str(text)).load({}) == b"ab" * 16


def test_the_model_length_is_the_models_own_unless_the_pool_or_the_flag_says_less():
    from shared.serving.pod.runtime import resolved_max_model_len

    pool = dataclasses.replace(PodConfig().cache, block_size=16, num_blocks=257)  # 256 usable blocks: 4,096 tokens
    assert resolved_max_model_len(PodConfig(cache=pool), model_limit=2048) == 2048
    assert resolved_max_model_len(PodConfig(cache=pool), model_limit=131072) == 4096
    assert resolved_max_model_len(PodConfig(cache=pool, max_model_len=1000), model_limit=131072) == 1000
    assert resolved_max_model_len(PodConfig(cache=pool, max_model_len=9000), model_limit=2048) == 2048
    with pytest.raises(ValueError, match="max_model_len must be >= 2"):
        PodConfig(max_model_len=1)
