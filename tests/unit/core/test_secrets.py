import pytest

from pretrainer.core.secrets import keep_secret, lost_secret, redact, reveal


@pytest.mark.parametrize(
    "uri, redacted",
    [
        ("http://ann:pw@host:5000/", "http://ann:***@host:5000/"),
        ("postgresql://u:p%40ss@db/mlflow", "postgresql://u:***@db/mlflow"),
        ("https://host/x?token=abc&page=2", "https://host/x?token=***&page=2"),
        (
            "s3://b/k?X-Amz-Signature=ff&X-Amz-Credential=id",
            "s3://b/k?X-Amz-Signature=***&X-Amz-Credential=***",
        ),
        ("https://host/x?api_key=k;sig=s", "https://host/x?api_key=***;sig=***"),
        ("sqlite:////runs/a/mlflow.db", "sqlite:////runs/a/mlflow.db"),
        ("runs/user:name@2/x", "runs/user:name@2/x"),  # a path, not a URI
        ("error at http://a:b@h and https://c:d@i", "error at http://a:***@h and https://c:***@i"),
        ("http://u:p@ss@host/x", "http://u:***@host/x"),  # a raw "@" in the password
        ("https://ghp_abcdefghijklmnopqrstuvwxyz0123@github.com/o/r", "https://***@github.com/o/r"),
        ("ssh://git@github.com/o/r", "ssh://***@github.com/o/r"),  # a user part alone may be a token
        ("http://ghp_short@host/x", "http://***@host/x"),
        ("https://host/x#tok3n", "https://host/x#***"),
        ("runs/a#1", "runs/a#1"),  # a path, not a URI
    ],
)
def test_uri_credentials_are_redacted_and_nothing_else(uri, redacted):
    assert redact(uri) == redacted
    assert redact(redacted) == redacted


def test_the_real_value_stays_in_the_process_for_connecting():
    kept = keep_secret("http://ann:pw2@host/")
    assert kept == "http://ann:***@host/" and reveal(kept) == "http://ann:pw2@host/"
    assert not lost_secret(kept) and lost_secret("http://bob:***@elsewhere/")
    assert keep_secret("/data/x&token=1") == "/data/x&token=1", "a path is not a URI: left as it is"
