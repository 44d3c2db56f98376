import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from pdd.modelgen import make_model

    d = tmp_path_factory.mktemp("models") / "tiny"
    make_model(str(d), preset="tiny", seed=0)
    return str(d)
