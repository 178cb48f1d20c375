"""One torch -> numpy dtype map: what the writer stores a tensor as is what the reader's check expects."""
import numpy as np
import pytest
import torch

from upd.runfile import encoding

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64, torch.complex128)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_writer_stores_what_the_reader_expects(dtype):
    stored, name = encoding.storage_numpy_dtype(dtype, "keep")
    assert name == encoding.dtype_name(dtype) and encoding.numpy_dtype_of(name) == stored
    array = encoding.tensor_to_numpy(torch.zeros(3, dtype=dtype), name)
    assert array.dtype == stored
    assert encoding.numpy_to_tensor(array, name).dtype == dtype


def test_bfloat16_is_stored_as_its_raw_bits():
    assert encoding.storage_numpy_dtype(torch.float32, "bfloat16") == (np.dtype(np.uint16), "bfloat16")
    x = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    assert torch.equal(encoding.numpy_to_tensor(encoding.tensor_to_numpy(x, "bfloat16"), "bfloat16"), x)


def test_names_from_a_file_are_looked_up_among_torch_dtypes_only():
    for name in ("os.system", "Tensor", "manual_seed", "no_such_dtype", "", "float32 "):
        assert encoding.numpy_dtype_of(name) is None


def test_a_dtype_numpy_cannot_hold_is_refused_not_stored_as_something_else():
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        encoding.storage_numpy_dtype(torch.float8_e4m3fn, "keep")
