"""An option that would do nothing is refused with an error naming it, never accepted and ignored."""

import pytest

from tandem.config import EngineConfig


def test_max_seq_len_to_capture_is_gone():
    # it had no reader; graphs cover steps up to max_cudagraph_capture_size tokens
    with pytest.raises(TypeError, match="unknown engine argument"):
        EngineConfig.from_kwargs(max_seq_len_to_capture=8192)
