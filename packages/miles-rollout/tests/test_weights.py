"""Multi-process tier: weight updates over real HTTP (from disk, from safetensors buckets, by torch.distributed
broadcast over gloo), versions, memory release / resume, and failure handling, against a real server."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import httpx
import pytest
import torch

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import (
    KernelConfig,
    broadcast_tensors,
    checkpoint_tensors,
    dtype_name,
    encode_bucket,
    init_weight_update_group,
    iter_buckets,
    load_model,
    native,
)
from miles_memory import ModelShape, embedded_engine_bytes, storage_bytes
from miles_rollout import Client, Engine, EngineConfig, InProcessClient, RolloutClientError, free_port

PROBE = GenerateRequest(
    input_ids=[[7, 8, 9, 10], [3] * 20],
    sampling_params=SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=3),
    return_logprob=True,
)


def outputs(responses) -> list[tuple]:
    return [(tuple(r.output_ids), tuple(e[0] for e in r.meta_info.output_token_logprobs)) for r in responses]


@pytest.fixture(scope="module")
def second_model(tmp_path_factory):
    from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config

    directory = tmp_path_factory.mktemp("dense-b")
    save_random_model(
        directory,
        tiny_config("dense", vocab_size=512, max_position_embeddings=512),
        seed=1,
        tokenizer=build_tokenizer(save_dir=directory),
    )
    return directory


@pytest.fixture(scope="module")
def server(dense_dir, start_server):
    with start_server(dense_dir, "--deterministic") as url:
        yield url


def fresh_engine_outputs(model_dir) -> list[tuple]:
    """What a freshly started deterministic engine with these weights answers (the reference)."""
    engine = Engine(str(model_dir), KernelConfig(page_size=16), EngineConfig(num_kv_pages=512))
    try:
        return outputs(asyncio.run(InProcessClient(engine).generate(PROBE)))
    finally:
        engine.shutdown()


def test_weight_updates_release_and_resume(server, dense_dir, second_model) -> None:
    reference_a = fresh_engine_outputs(dense_dir)
    reference_b = fresh_engine_outputs(second_model)
    assert reference_a != reference_b

    async def scenario() -> None:
        async with Client(server) as client:
            first = await client.generate(PROBE)
            assert outputs(first) == reference_a and first[0].meta_info.weight_version is None  # "default"

            # From disk, no version given: the version stays, as in SGLang; the new weights are served.
            reply = await client.update_weights_from_disk(str(second_model))
            assert reply["weight_version"] is None and await client.get_weight_version() is None
            assert outputs(await client.generate(PROBE)) == reference_b
            reply = await client.update_weights_from_disk(str(second_model), weight_version=1)
            assert reply["weight_version"] == 1 and await client.get_weight_version() == 1
            after_disk = await client.generate(PROBE)
            assert outputs(after_disk) == reference_b and after_disk[0].meta_info.weight_version == 1

            # From buckets (HF names, tied embeddings once), applied when the last bucket arrives.
            tensors = list(checkpoint_tensors(load_model(dense_dir)).items())
            buckets = list(iter_buckets(tensors, version=5, bucket_bytes=40_000))
            assert len(buckets) > 2
            partial = await client.update_weights_from_tensor(buckets[0])
            assert partial["complete"] is False and await client.get_weight_version() == 1
            done = await client.update_weights_from_buckets(buckets[1:])
            assert done["complete"] is True and done["weight_version"] == 5
            assert outputs(await client.generate(PROBE)) == reference_a

            # Release both tags: generation is refused with a clear error until resume + a weight update.
            await client.release_memory_occupation(["weights", "kv_cache"])
            with pytest.raises(RolloutClientError, match="memory is released"):
                await client.generate(PROBE)
            await client.resume_memory_occupation()
            with pytest.raises(RolloutClientError, match="update weights before generating"):
                await client.generate(PROBE)
            await client.update_weights_from_disk(str(second_model), weight_version=9)
            resumed = await client.generate(PROBE)
            assert outputs(resumed) == reference_b and resumed[0].meta_info.weight_version == 9

    asyncio.run(scenario())


def test_release_frees_storage_in_process(dense_dir) -> None:
    """The engine's memory by tag, as `/get_server_info` reports it and as the memory planner predicts it
    (`miles_memory.embedded_engine_bytes`, exact, the native linear's packed weights included once it ran), drops to
    nothing on release and comes back, zeroed, on resume."""
    engine = Engine(str(dense_dir), KernelConfig(page_size=16), EngineConfig(num_kv_pages=64))
    client = InProcessClient(engine)
    try:
        kv_bytes = sum(t.untyped_storage().nbytes() for t in engine.runner.store.k + engine.runner.store.v)
        weight_bytes = storage_bytes(engine.model.parameters())
        assert kv_bytes > 0 and weight_bytes > 0
        reported = asyncio.run(client.get_server_info())["memory_bytes"]
        assert reported == {"weights": weight_bytes, "kv_cache": kv_bytes}
        shape = ModelShape.from_hf(json.loads((dense_dir / "config.json").read_text()))
        assert embedded_engine_bytes(shape, "float32", 64, 16) == reported
        # From the first forward on, the native linear's packed copies of the weights belong to the weights
        asyncio.run(client.generate(PROBE))
        packed = native.packed_weights(engine.model.parameters())
        assert (
            packed
            and reported["weights"] + storage_bytes(packed)
            == (embedded_engine_bytes(shape, "float32", 64, 16, packed_width=native.panel_width())["weights"])
        )
        reported = asyncio.run(client.get_server_info())["memory_bytes"]
        assert reported["weights"] == weight_bytes + storage_bytes(packed)
        asyncio.run(client.release_memory_occupation())
        assert sum(t.untyped_storage().nbytes() for t in engine.runner.store.k + engine.runner.store.v) == 0
        assert sum(p.untyped_storage().nbytes() for p in [*engine.model.parameters(), *packed]) == 0
        assert asyncio.run(client.get_server_info())["memory_bytes"] == {"weights": 0, "kv_cache": 0}
        asyncio.run(client.resume_memory_occupation())
        assert asyncio.run(client.get_server_info())["memory_bytes"] == reported
        assert all(not t.any() for t in engine.runner.store.k + engine.runner.store.v)
        with pytest.raises(RolloutClientError, match="unknown memory tag 'gpu'"):
            asyncio.run(client.release_memory_occupation(["gpu"]))
    finally:
        engine.shutdown()


def test_distributed_update_over_gloo(server, second_model, dense_dir) -> None:
    reference_b = fresh_engine_outputs(second_model)
    reference_a = fresh_engine_outputs(dense_dir)
    tensors = checkpoint_tensors(load_model(second_model))
    tensors_a = checkpoint_tensors(load_model(dense_dir))
    names, names_a = list(tensors), list(tensors_a)
    master_port = free_port()

    async def scenario() -> None:
        async with Client(server) as client:
            holder: dict[str, object] = {}
            host = threading.Thread(
                target=lambda: holder.setdefault("group", init_weight_update_group("127.0.0.1", master_port, 0, 2)),
            )
            host.start()
            await client.init_weights_update_group("127.0.0.1", master_port, rank_offset=1, world_size=2)
            host.join(timeout=60)
            sender = threading.Thread(
                target=lambda: broadcast_tensors(holder["group"], [tensors[n] for n in names], src=0)  # type: ignore[arg-type]
            )
            sender.start()
            reply = await client.update_weights_from_distributed(
                names,
                [dtype_name(tensors[n].dtype) for n in names],
                [list(tensors[n].shape) for n in names],
                weight_version=7,
            )
            sender.join(timeout=60)
            assert reply["weight_version"] == 7
            assert outputs(await client.generate(PROBE)) == reference_b
            with pytest.raises(RolloutClientError, match="no weight update group 'nope'"):
                await client.update_weights_from_distributed(names[:1], ["float32"], [[1]], group_name="nope")

            # slime's bucketed update (sglang_engine.py at 03b32d8: one call per bucket, flush_cache=False,
            # weight_version as a string), bracketed so that no request runs on a half-updated model.
            raw = httpx.AsyncClient(base_url=server, timeout=120)

            async def post_json(path: str, body: dict) -> dict:
                response = await raw.post(path, json=body)
                assert response.status_code == 200, response.text
                return response.json()  # type: ignore[no-any-return]

            assert (await post_json("/pause_generation", {}))["status"] == "ok"
            await post_json("/begin_weight_update", {})
            for bucket in (names_a[: len(names_a) // 2], names_a[len(names_a) // 2 :]):
                sender = threading.Thread(
                    target=lambda b=bucket: broadcast_tensors(holder["group"], [tensors_a[n] for n in b], src=0)  # type: ignore[arg-type]
                )
                sender.start()
                await post_json("/update_weights_from_distributed", {
                    "names": bucket, "dtypes": [dtype_name(tensors_a[n].dtype) for n in bucket],
                    "shapes": [list(tensors_a[n].shape) for n in bucket], "group_name": "weight_update_group",
                    "flush_cache": False,
                })  # fmt: skip
                sender.join(timeout=60)
            assert (await post_json("/end_weight_update", {"weight_version": "8"}))["weight_version"] == "8"
            await post_json("/continue_generation", {})
            assert outputs(await client.generate(PROBE)) == reference_a
            await post_json("/destroy_weights_update_group", {"group_name": "weight_update_group"})
            await raw.aclose()

    asyncio.run(scenario())


def test_bad_weight_updates_are_rejected_and_the_server_keeps_serving(server, dense_dir, tmp_path) -> None:
    async def scenario() -> None:
        async with Client(server) as client:
            before = outputs(await client.generate(PROBE))
            version = await client.get_weight_version()
            with pytest.raises(RolloutClientError, match="invalid weight bucket"):
                await client.update_weights_from_tensor(b"not a safetensors file")
            bad = encode_bucket(
                {"model.layers.99.mlp.up_proj.weight": __import__("torch").zeros(2)}, version=50, index=0, count=1
            )
            with pytest.raises(
                RolloutClientError, match=r"unexpected tensor 'model\.layers\.99\.mlp\.up_proj\.weight'"
            ):
                await client.update_weights_from_tensor(bad)
            with pytest.raises(RolloutClientError, match=r"HTTP 400.*'/nonexistent/dir' is not a directory"):
                await client.update_weights_from_disk("/nonexistent/dir")
            with pytest.raises(RolloutClientError, match=r"HTTP 400.*config\.json not found"):
                await client.update_weights_from_disk(str(tmp_path))  # a directory, but no checkpoint
            assert await client.get_weight_version() == version
            assert outputs(await client.generate(PROBE)) == before

    asyncio.run(scenario())


def test_update_waits_for_running_requests(server, dense_dir, wait_for_engine) -> None:
    """A request that started on version v finishes on v: the update is applied after it, between steps."""

    async def scenario() -> None:
        async with Client(server) as client:
            version = await client.get_weight_version() or 0
            long = asyncio.create_task(
                client.generate(
                    GenerateRequest(
                        input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=150, ignore_eos=True)
                    )
                )
            )
            await wait_for_engine(server, lambda s: s["num_running"] == 1)  # the request is decoding
            update = await client.update_weights_from_disk(str(dense_dir), weight_version=version + 1)
            finished = (await long)[0]
            assert long.done() and update["weight_version"] == version + 1
            assert finished.meta_info.weight_version == version and len(finished.output_ids) == 150

    asyncio.run(scenario())


def test_admin_endpoints_need_admin_key_on_non_loopback(dense_dir) -> None:
    from miles_rollout import create_app

    engine = Engine(str(dense_dir), KernelConfig(page_size=16), EngineConfig(num_kv_pages=64))
    try:
        app = create_app(engine, host="0.0.0.0")

        async def scenario() -> tuple[int, int]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                flush = await client.post("/flush_cache")
                health = await client.get("/health")
                return flush.status_code, health.status_code

        assert asyncio.run(scenario()) == (403, 200)
    finally:
        engine.shutdown()


def test_weights_checksum_tracks_the_served_weights(server, dense_dir, second_model) -> None:
    """/weights_checksum equals `weights_checksum` of the checkpoint's tensors in the engine dtype, changes with a
    bucket update to other weights, and is admin-only (loopback bind without an admin key: allowed here)."""
    from miles_kernels import weights_checksum

    def expected(model_dir) -> str:
        return weights_checksum(checkpoint_tensors(load_model(model_dir, KernelConfig())).items())

    async def scenario() -> tuple[str, str, str]:
        async with Client(server) as client:
            await client.update_weights_from_disk(str(dense_dir), weight_version=40)
            before = await client.weights_checksum()
            tensors = list(checkpoint_tensors(load_model(second_model, KernelConfig())).items())
            await client.update_weights_from_buckets(iter_buckets(tensors, version=41, bucket_bytes=1 << 16))
            after = await client.weights_checksum()
            await client.update_weights_from_disk(str(dense_dir), weight_version=42)
            return before, after, await client.weights_checksum()

    before, after, restored = asyncio.run(scenario())
    assert before == expected(dense_dir) == restored
    assert after == expected(second_model) != before


def test_a_weight_file_rewritten_in_place_is_served_after_each_update(server, dense_dir, second_model, tmp_path):
    """The trainer's same-node sync: one checkpoint file, overwritten in place before every
    /update_weights_from_disk. The engine keeps that file mapped between updates; each update must serve the bytes
    the file holds at that moment (never a stale page), bit for bit."""
    from miles_kernels import MappedSafetensors, weights_checksum

    sync = tmp_path / "sync"
    sync.mkdir()
    shutil.copy(dense_dir / "config.json", sync)
    shutil.copy(dense_dir / "model.safetensors", sync)
    writer = MappedSafetensors()

    def overwrite_with(model_dir) -> str:
        tensors = checkpoint_tensors(load_model(model_dir, KernelConfig()))
        inode = (sync / "model.safetensors").stat().st_ino
        for name, (_, data) in writer.slots(sync / "model.safetensors").items():
            data.copy_(tensors[name].reshape(-1).view(torch.uint8))
        assert (sync / "model.safetensors").stat().st_ino == inode
        return weights_checksum(tensors.items())

    async def served(version: int) -> tuple[str, list[tuple]]:
        async with Client(server) as client:
            await client.update_weights_from_disk(str(sync), weight_version=version)
            return await client.weights_checksum(), outputs(await client.generate(PROBE))

    first = asyncio.run(served(50))
    second_checksum = overwrite_with(second_model)
    second = asyncio.run(served(51))
    first_checksum = overwrite_with(dense_dir)
    again = asyncio.run(served(52))
    assert first == (first_checksum, fresh_engine_outputs(dense_dir)) == again
    assert second == (second_checksum, fresh_engine_outputs(second_model))
    assert second_checksum != first_checksum


def test_only_a_shared_memory_weight_file_stays_mapped(dense_dir, second_model, tmp_path) -> None:
    """After `/update_weights_from_disk` the engine keeps the file mapped only when it is in /dev/shm (the trainer's
    same-node sync, rewritten in place every step); a checkpoint elsewhere is unmapped, so deleting it frees its
    disk space. Checked in the process's own memory map."""
    import tempfile
    from pathlib import Path

    maps = Path("/proc/self/maps")
    if not maps.exists() or not Path("/dev/shm").is_dir():
        pytest.skip("needs /proc/self/maps and /dev/shm (Linux)")
    engine = Engine(str(dense_dir), KernelConfig(page_size=16), EngineConfig(num_kv_pages=64))
    shm = Path(tempfile.mkdtemp(prefix="miles-test-", dir="/dev/shm"))
    try:
        for directory in (shm, tmp_path / "disk"):
            shutil.copytree(second_model, directory, dirs_exist_ok=True)
            client = InProcessClient(engine)
            asyncio.run(client.update_weights_from_disk(str(directory)))
            mapped = str(directory.resolve() / "model.safetensors") in maps.read_text()
            assert mapped == (directory == shm), directory
        assert asyncio.run(InProcessClient(engine).generate(PROBE))  # still serving
    finally:
        engine.shutdown()
        shutil.rmtree(shm, ignore_errors=True)


def test_a_restarted_engine_copies_the_weights_of_a_healthy_one(server, dense_dir, second_model, start_server) -> None:
    """`GET /weight_buckets` (admin) hands out the served weights bucket by bucket under the served version; posted to
    another engine's `/update_weights_from_tensor` they make it serve the same bits and version (how a restarted
    engine is re-synced when no weight file holds them), also after an interrupted attempt (bucket 0 starts a version
    over). Bad indices and an unversioned engine are 4xx."""

    async def scenario(target_url: str) -> None:
        async with Client(server) as source, Client(target_url) as target:
            with pytest.raises(RolloutClientError) as unversioned:
                await target.get_weight_bucket(0)  # started from a checkpoint: no version to hand out
            assert unversioned.value.status_code == 409
            await source.update_weights_from_disk(str(dense_dir), weight_version=50)
            assert await target.weights_checksum() != await source.weights_checksum()
            for index in (0, 1):  # an attempt interrupted after two buckets: sending again starts over at bucket 0
                partial = await target.update_weights_from_tensor((await source.get_weight_bucket(index, 1 << 16))[0])
                assert not partial["complete"]
            index, count = 0, 1
            while index < count:
                data, count = await source.get_weight_bucket(index, bucket_bytes=1 << 16)
                reply = await target.update_weights_from_tensor(data)
                index += 1
            assert count > 2 and reply["complete"] and reply["weight_version"] == 50
            assert await target.weights_checksum() == await source.weights_checksum()
            assert await target.get_weight_version() == 50
            with pytest.raises(RolloutClientError) as out_of_range:
                await source.get_weight_bucket(count, bucket_bytes=1 << 16)
            assert out_of_range.value.status_code == 400 and f"make {count} bucket(s)" in str(out_of_range.value)

    with start_server(second_model, "--deterministic") as target_url:
        asyncio.run(scenario(target_url))


def test_a_weight_version_is_any_string_reported_back_unchanged(server, dense_dir) -> None:
    """SGLang takes any string as `weight_version` (its `Optional[str]`) and reports it back as sent: on the update's
    reply, `/get_weight_version` and each response's `meta_info`; the orchestrator's own versions stay integers."""

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server, timeout=120) as raw, Client(server) as client:

            async def post(path: str, body: dict) -> httpx.Response:
                return await raw.post(path, json=body)

            reply = await post("/update_weights_from_disk", {"model_path": str(dense_dir), "weight_version": "load-2"})
            assert reply.status_code == 200 and reply.json()["weight_version"] == "load-2", reply.text
            assert (await raw.get("/get_weight_version")).json()["weight_version"] == "load-2"
            generated = await post("/generate", {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 2}})
            assert generated.json()["meta_info"]["weight_version"] == "load-2"
            (response,) = await client.generate(PROBE.model_copy(update={"input_ids": [[7, 8, 9]]}))
            assert response.meta_info.weight_version == "load-2" and response.meta_info.policy_version is None
            assert await client.get_weight_version() == "load-2"
            info = (await raw.get("/get_server_info")).json()
            assert info["weight_version"] == "load-2"
            metrics = (await raw.get("/metrics")).text.splitlines()
            (gauge,) = [line for line in metrics if line.startswith("miles:weight_version{")]
            assert gauge.endswith(" -1.0")  # a label is no number

            reply = await post("/update_weight_version", {"new_version": "rc/3 (with spaces)"})
            assert reply.status_code == 200 and reply.json()["new_version"] == "rc/3 (with spaces)", reply.text
            assert (await post("/begin_weight_update", {})).status_code == 200
            assert (await post("/end_weight_update", {"weight_version": "x"})).json()["weight_version"] == "x"
            for bad, why in ((-1, ">= 0"), (True, "a string"), ("", "1 to 256"), ("v" * 257, "1 to 256"),
                             ("a\nb", "printable"), ([1], "a string")):  # fmt: skip
                reply = await post("/update_weight_version", {"new_version": bad})
                assert reply.status_code == 400 and why in reply.text, (bad, reply.text)
            assert (await raw.get("/get_weight_version")).json()["weight_version"] == "x"  # nothing changed

            # digits, as a string or a number, are the orchestrator's policy step
            assert (await post("/update_weight_version", {"new_version": 12})).json()["new_version"] == "12"
            assert await client.get_weight_version() == 12
            (response,) = await client.generate(PROBE.model_copy(update={"input_ids": [[7, 8, 9]]}))
            assert response.meta_info.weight_version == 12 and response.meta_info.policy_version == 12

    asyncio.run(scenario())
