"""Shared real-digits fixtures: the classifier is trained once per session in a tmp cache directory."""

import pytest

from miles.eval.digits.classifier import load_classifier
from miles.eval.digits.data import load_split


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("classifier_cache")


@pytest.fixture(scope="session")
def clf(cache_dir):
    return load_classifier(cache_dir)


@pytest.fixture(scope="session")
def heldout():
    return load_split("heldout")


@pytest.fixture(scope="session")
def train():
    return load_split("train")
