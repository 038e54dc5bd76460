"""ZMQ CURVE for telemetry lanes that cross hosts: key files, and socket set-up on each side.

A lane that leaves the host (``tcp://``) is encrypted and authenticated with CURVE: the
sidecar (the PULL side, a CURVE server) accepts an engine (a PUSH side, a CURVE client) only
if the engine proves it holds a secret key whose public half is listed in ``clients/``. An
engine without keys, with unlisted keys, or with a wrong server key never completes the
handshake, so it delivers nothing (its publisher counts every send as dropped).

One keys directory, of which each host gets the part it needs (the ZeroMQ certificate file
format, as written by ``zmq.auth``)::

    KEYS_DIR/
      server.key          the sidecar's public key          -> every engine host
      server.key_secret   the sidecar's secret key          -> the sidecar host only
      clients/NAME.key    public key of each accepted engine -> the sidecar host
      NAME.key_secret     engine NAME's secret key          -> that engine's host only

Server-side checking of client keys runs in pyzmq's ZAP authenticator thread, one per ZMQ
context, started by ``configure_server`` and stopped by ``stop_server_auth`` (stop it before
terminating the context, whose ``term()`` waits for the authenticator's socket).

Generate keys with ``iterscope curve-keys KEYS_DIR --engines engine-a engine-b`` (or
``python -m telemetry.lane.curve``, the same command).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import threading
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

PROG = "iterscope curve-keys"
SERVER_NAME = "server"
CLIENTS_DIR = "clients"
DEFAULT_ENGINE_NAME = "engine"
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

_authenticators: dict[zmq.Context, tuple[ThreadAuthenticator, Path]] = {}
_authenticators_lock = threading.Lock()


def generate_keys(keys_dir: str | os.PathLike, engine_names: list[str]) -> None:
    """Create the server certificate (if absent) and one certificate per engine name.

    Existing certificates are kept, so adding an engine later does not invalidate the others.
    Secret files are made readable by their owner only. Names and the path are checked before
    anything is written (ValueError for an invalid name, NotADirectoryError for a file where
    the directory should be); an OSError while writing leaves no partial certificate, nor the
    keys directory when this call created it.
    """
    root = Path(keys_dir)
    for name in engine_names:
        _check_name(name)
    _check_keys_dir(root)
    created_root = not root.exists()
    try:
        _write_missing_certificates(root, engine_names)
    except OSError:
        if created_root:
            shutil.rmtree(root, ignore_errors=True)
        raise


def _write_missing_certificates(root: Path, engine_names: list[str]) -> None:
    (root / CLIENTS_DIR).mkdir(parents=True, exist_ok=True)
    if not (root / f"{SERVER_NAME}.key_secret").exists():
        _create_certificate(root, SERVER_NAME, root)
    for name in engine_names:
        if not (root / f"{name}.key_secret").exists():
            _create_certificate(root, name, root / CLIENTS_DIR)


def configure_server(socket: zmq.Socket, keys_dir: str | os.PathLike) -> ThreadAuthenticator:
    """Make ``socket`` a CURVE server that accepts only engines listed in ``keys_dir/clients``.

    Call before ``bind``. Returns the context's authenticator (shared by every server socket
    of that context; one keys directory per context).
    """
    root = Path(keys_dir)
    public_key, secret_key = _load_secret_certificate(root / f"{SERVER_NAME}.key_secret")
    clients_dir = _checked_clients_dir(root / CLIENTS_DIR)
    authenticator = _start_authenticator(socket.context, clients_dir)
    socket.curve_secretkey = secret_key
    socket.curve_publickey = public_key
    socket.curve_server = True
    return authenticator


def configure_client(
    socket: zmq.Socket, keys_dir: str | os.PathLike, engine_name: str = DEFAULT_ENGINE_NAME
) -> None:
    """Make ``socket`` a CURVE client holding engine ``engine_name``'s keys. Call before
    ``connect``; needs ``keys_dir/server.key`` and ``keys_dir/<engine_name>.key_secret``."""
    _check_name(engine_name)
    root = Path(keys_dir)
    public_key, secret_key = _load_secret_certificate(root / f"{engine_name}.key_secret")
    server_key = _load_public_key(root / f"{SERVER_NAME}.key")
    socket.curve_secretkey = secret_key
    socket.curve_publickey = public_key
    socket.curve_serverkey = server_key


def stop_server_auth(context: zmq.Context) -> None:
    """Stop the authenticator ``configure_server`` started for ``context`` (no-op if none)."""
    with _authenticators_lock:
        entry = _authenticators.pop(context, None)
    if entry is not None:
        entry[0].stop()


def _start_authenticator(context: zmq.Context, clients_dir: Path) -> ThreadAuthenticator:
    with _authenticators_lock:
        entry = _authenticators.get(context)
        if entry is not None:
            authenticator, configured_dir = entry
            if configured_dir != clients_dir:
                raise ValueError(
                    f"this ZMQ context already authenticates CURVE clients from "
                    f"{configured_dir}; use one keys directory per context, not also {clients_dir}"
                )
            return authenticator
        authenticator = ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=str(clients_dir))
        _authenticators[context] = (authenticator, clients_dir)
        return authenticator


def _check_keys_dir(root: Path) -> None:
    """The nearest existing path of ``root/clients``, ``root`` and its parents is a directory."""
    for path in (root / CLIENTS_DIR, root, *root.parents):
        if path.exists():
            if not path.is_dir():
                raise NotADirectoryError(f"{path} is a file, not a directory")
            return


def _create_certificate(root: Path, name: str, public_dir: Path) -> None:
    """Write ``root/NAME.key_secret`` and ``public_dir/NAME.key``: both, or neither."""
    public_file = public_dir / f"{name}.key"
    try:
        created_public, secret_file = zmq.auth.create_certificates(root, name)
        os.chmod(secret_file, 0o600)
        os.replace(created_public, public_file)
    except OSError:
        for path in (root / f"{name}.key", root / f"{name}.key_secret", public_file):
            path.unlink(missing_ok=True)
        raise


def _load_secret_certificate(path: Path) -> tuple[bytes, bytes]:
    if not path.is_file():
        raise FileNotFoundError(
            f"CURVE secret key file {path} not found; create keys with "
            f"`{PROG} {path.parent} --engines NAME ...`"
        )
    public_key, secret_key = zmq.auth.load_certificate(path)
    if not secret_key:
        raise ValueError(f"{path} holds no secret-key: is it a public .key file?")
    return public_key, secret_key


def _load_public_key(path: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(
            f"CURVE public key file {path} not found; copy the sidecar's {path.name} "
            "from the keys directory it was generated in"
        )
    public_key, _ = zmq.auth.load_certificate(path)
    return public_key


def _checked_clients_dir(clients_dir: Path) -> Path:
    if not clients_dir.is_dir() or not any(clients_dir.glob("*.key")):
        raise FileNotFoundError(
            f"no engine public keys (*.key) in {clients_dir}: the sidecar would accept no "
            f"engine; generate them with `{PROG} KEYS_DIR --engines NAME`"
        )
    return clients_dir.resolve()


def _check_name(name: str) -> None:
    if not _NAME_PATTERN.match(name) or name == SERVER_NAME:
        raise ValueError(
            f"invalid engine name {name!r}: use letters, digits, '.', '_' or '-', "
            f"not starting with a punctuation mark, and not {SERVER_NAME!r}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Create CURVE keys for telemetry lanes across hosts (see docs/deploy.md).",
    )
    parser.add_argument("keys_dir", help="directory to create or extend")
    parser.add_argument(
        "--engines",
        nargs="+",
        default=[DEFAULT_ENGINE_NAME],
        metavar="NAME",
        help=f"one certificate per engine host (default: {DEFAULT_ENGINE_NAME})",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        generate_keys(args.keys_dir, args.engines)
    except (ValueError, OSError) as error:
        print(f"{PROG}: {_error_text(error, args.keys_dir)}", file=sys.stderr)
        return 2
    root = Path(args.keys_dir)
    print(f"sidecar host: {root / 'server.key_secret'} and {root / CLIENTS_DIR}/")
    for name in args.engines:
        print(f"engine {name}: {root / (name + '.key_secret')} and {root / 'server.key'}")
    return 0


def _error_text(error: Exception, keys_dir: str) -> str:
    """One line for what went wrong: the check's own words, or the OS's about a path."""
    if isinstance(error, NotADirectoryError) and not error.filename:
        return f"{error}: KEYS_DIR must be a directory to create or extend"
    if isinstance(error, OSError):
        path = error.filename or keys_dir
        return f"cannot create or write {path}: {error.strerror or error}"
    return str(error)


if __name__ == "__main__":
    sys.exit(main())
