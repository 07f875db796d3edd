import importlib.util

from twinkle_fn import _triton


def test_available_says_whether_triton_imports_and_is_cached():
    assert _triton.available() is (importlib.util.find_spec("triton") is not None)
    assert _triton.available.cache_info().currsize == 1
