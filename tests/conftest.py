import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with an empty dynamo cache, so compile counts never depend on test order."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
