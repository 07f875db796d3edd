"""Upstream Twinkle's module surface: the names its cookbooks and docs import, used as they are
documented (``get_logger``, ``Platform``, ``get_device_placement``, ``twinkle.hub``,
``twinkle.data_format``, ``twinkle.preprocessor``)."""

import logging

import pytest

import twinkle
from twinkle import DeviceMesh, Platform, get_device_placement, get_logger
from twinkle.data_format import Message, Trajectory, pack_value, user_data_get
from twinkle.hub import HubOperation, HubUnavailableError
from twinkle.infra import DeviceGroup
from twinkle.preprocessor import (
    AlpacaProcessor,
    CompetitionMathProcessor,
    CountdownProcessor,
    DataFilter,
    EmojiDPOProcessor,
    GSM8KProcessor,
    Preprocessor,
    SelfCognitionProcessor,
)


@pytest.fixture
def restore_settings():
    # initialize sets process-wide settings; give them back after the test
    before = twinkle.infra.settings()
    yield
    twinkle.infra._SETTINGS[0] = before


def test_device_placement_before_and_after_initialize(restore_settings):
    assert twinkle.infra.get_device_placement is get_device_placement
    text = get_device_placement([DeviceGroup("model", [0, 1, 2, 3], "GPU")])
    assert "DeviceGroup: model" in text and "[0, 1, 2, 3]" in text and "GPU" in text
    twinkle.initialize(mode="local", global_device_mesh=DeviceMesh.from_sizes(dp_size=1))
    text = get_device_placement()
    assert "DeviceGroup: default" in text and "dp=1" in text


def test_platform_reads_the_launcher_environment(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert (Platform.get_rank(), Platform.get_world_size()) == (-1, 1)
    assert Platform.is_master() and Platform.is_last_rank()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert Platform.get_rank() == 3 and not Platform.is_master() and Platform.is_last_rank()
    assert not Platform.is_local_master()
    assert Platform.get_local_device(platform="GPU") == "cuda:1"
    assert Platform.device_prefix("cuda") == "cuda" and Platform.device_backend("GPU") == "nccl"
    assert Platform.get_peer_index(8, rank=1, world_size=4) == slice(2, 4)
    assert Platform.get_peer_index(2, rank=3, world_size=4) == slice(1, 2)
    with pytest.raises(ValueError, match="torch_npu"):
        Platform.get_platform("NPU")


def test_logger_logs_on_the_local_master_only(monkeypatch, tmp_path):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    log = tmp_path / "run.log"
    logger = get_logger(log_file=str(log), log_level="INFO")
    assert logger.name == "twinkle" and not logger.propagate
    logger.info("hello %s", "world")
    for h in logger.handlers:
        h.flush()
    assert "[INFO:twinkle] hello world" in log.read_text()
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert get_logger().level == logging.ERROR


def test_hub_serves_local_paths_and_refuses_hub_ids(tmp_path):
    assert HubOperation.download_model(str(tmp_path)) == str(tmp_path)
    assert HubOperation.source_type("hf://Qwen/Qwen3-4B") == "hf"
    assert HubOperation.source_type("ms://Qwen/Qwen3-4B") == "ms"
    assert HubOperation.remove_source_type("ms://Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"
    with pytest.raises(HubUnavailableError, match="local directory"):
        HubOperation.download_model("ms://Qwen/Qwen3-4B")
    with pytest.raises(HubUnavailableError, match="ms://swift/self-cognition"):
        HubOperation.load_dataset("ms://swift/self-cognition", "default", "train")
    with pytest.raises(HubUnavailableError):
        HubOperation.push_to_hub("me/model", str(tmp_path))


def test_user_data_round_trips_json():
    items = [("answer", pack_value({"x": [1, 2]})), ("plain", "not json")]
    traj = Trajectory(messages=[Message(role="user", content="hi")], user_data=items)
    assert user_data_get(traj["user_data"], "answer") == {"x": [1, 2]}
    assert user_data_get(items, "plain") == "not json"
    assert user_data_get(items, "missing", 0) == 0 and user_data_get(None, "answer") is None


def test_self_cognition_fills_the_placeholders_batched():
    cols = {"query": ["who are you?", "name?"], "response": ["I am {{NAME}} by {{AUTHOR}}", "x"]}
    out = SelfCognitionProcessor("twinkle-bot", "ModelScope")(cols)
    assert list(out) == ["messages"] and len(out["messages"]) == 2
    assert out["messages"][0] == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "who are you?"},
        {"role": "assistant", "content": "I am twinkle-bot by ModelScope"},
    ]
    default = SelfCognitionProcessor().preprocess({"query": "{{NAME}}", "response": "{{AUTHOR}}"})
    assert [m["content"] for m in default["messages"][1:]] == ["twinkle robot", "twinkle lab"]


def test_row_preprocessors():
    alpaca = AlpacaProcessor().preprocess({"instruction": "Add", "input": "1 2", "output": "3"})
    assert alpaca["messages"] == [
        {"role": "user", "content": "Add\n1 2"},
        {"role": "assistant", "content": "3"},
    ]
    gsm = GSM8KProcessor(add_assistant=True).preprocess(
        {"question": "q", "answer": "work\n#### 1,234"}
    )
    assert user_data_get(gsm["user_data"], "ground_truth") == 1234
    assert [m["role"] for m in gsm["messages"]] == ["system", "user", "assistant"]
    math = CompetitionMathProcessor()({"problem": ["p"], "solution": ["s"]})
    assert math["messages"][0][1] == {"role": "assistant", "content": "s"}
    countdown = CountdownProcessor().preprocess({"nums": [1, 2], "target": 3})
    assert "equals 3" in countdown["messages"][1]["content"]
    dpo = EmojiDPOProcessor(system="sys")({"prompt": ["p"], "answer_zh": ["y"], "answer_en": ["n"]})
    assert dpo["positive"][0]["messages"][-1]["content"] == "y"
    assert dpo["negative"][0]["messages"][0] == {"role": "system", "content": "sys"}


def test_preprocessor_column_helpers():
    rows = [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert Preprocessor.map_row_to_col(rows) == {"a": [1, 3], "b": [2, 4]}
    assert Preprocessor.map_col_to_row({"a": [1, 3], "b": [2, 4]}) == rows
    assert Preprocessor.map_row_to_col([], ["a"]) == {"a": []}
    with pytest.raises(NotImplementedError):
        DataFilter()({"a": 1})


def test_hub_is_a_package_with_upstreams_hub_module():
    """Upstream's tests import ``twinkle.hub.hub`` (the module) and replace its upload pool."""
    import twinkle.hub.hub as hub_module

    assert hub_module.HubOperation is HubOperation and hasattr(hub_module, "_executor")
    with pytest.raises(HubUnavailableError, match="upload to 'me/repo'"):
        HubOperation.async_push_to_hub("me/repo", ".")
