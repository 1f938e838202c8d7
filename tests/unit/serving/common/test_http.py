import pytest

from serving.common.http import field_path, validation_error_to_api_error


@pytest.mark.parametrize(
    ("loc", "path"),
    [
        (("body", "prompt"), "prompt"),
        (("body", "inputs", 0, "datatype"), "inputs[0].datatype"),
        (("body", "inputs", 2, "data", 5), "inputs[2].data[5]"),
        (("query", "limit"), "limit"),
        (("body",), ""),
    ],
)
def test_field_path_reads_like_the_request(loc, path):
    assert field_path(loc) == path


def test_first_error_wins_and_the_rest_are_counted():
    error = validation_error_to_api_error([
        {"type": "missing", "loc": ("body", "prompt"), "msg": "Field required"},
        {"type": "int_parsing", "loc": ("body", "n"), "msg": "not an int"},
    ])
    assert (error.status_code, error.param) == (400, "prompt")
    assert error.message == "prompt: field required (1 more error(s))"


def test_invalid_json_names_the_body():
    error = validation_error_to_api_error([
        {"type": "json_invalid", "loc": ("body", 9), "msg": "JSON decode error",
         "ctx": {"error": "Expecting value"}},
    ])
    assert (error.param, error.code) == ("body", "invalid_json")
    assert "Expecting value" in error.message
