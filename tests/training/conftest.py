"""What the model tests share: a corpus of their own, so no test walks site-packages."""

from pathlib import Path

import pytest
from helpers import write_source_corpus


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_source_corpus(root)
    return root
