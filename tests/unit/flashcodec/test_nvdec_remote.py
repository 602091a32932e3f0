"""The NVDEC helper process's start-up on a machine where it cannot open NVDEC: it starts, says why it cannot
decode, and the parent raises HelperError with that reason (NvdecDecoder then decodes on that GPU itself).
Decoding through helpers is tested on two GPUs: tests/gpu/test_nvdec_multi_gpu.py."""
import pytest
import torch

from flashcodec.nvdec_remote import HelperError, NvdecHelper


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the helper may well start")
def test_a_helper_without_nvdec_says_why():
    with pytest.raises(HelperError, match=r"GPU 0 did not start: \('failed', '[A-Za-z]+Error: "):
        NvdecHelper(0, sessions=1, max_gop_size=256)
