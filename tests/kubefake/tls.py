"""Certificates for the fake over TLS, made with the `openssl` command: a self-signed CA and
a server certificate it signs for one IP address (the address the client dials, in its
subjectAltName), with the extensions a strict verifier asks for (Python 3.13's default
context sets VERIFY_X509_STRICT: key usages and key identifiers)."""
from __future__ import annotations

import ssl
import subprocess
from pathlib import Path
from typing import NamedTuple


class Certs(NamedTuple):
    ca: Path  # the CA certificate a client trusts (the pod's ca.crt)
    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, self.key)
        return context


CA_EXTENSIONS = ("basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n"
                 "subjectKeyIdentifier=hash\n")
SERVER_EXTENSIONS = ("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                     "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
                     "subjectAltName=IP:{ip}\n")


def make_certs(directory: Path, ip: str) -> Certs:
    """A CA and a server certificate for `ip` (valid a day), written into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    certs = Certs(directory / "ca.crt", directory / "server.crt", directory / "server.key")
    ca_key, csr = directory / "ca.key", directory / "server.csr"
    (directory / "ca.ext").write_text(CA_EXTENSIONS)
    (directory / "server.ext").write_text(SERVER_EXTENSIONS.format(ip=ip))
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]  # EC: milliseconds, not RSA's seconds
    _openssl("req", "-x509", *ec, "-keyout", ca_key, "-out", certs.ca, "-days", "1", "-subj", "/CN=kubefake-ca",
             "-extensions", "v3", "-config", _config(directory, "ca.ext"))
    _openssl("req", "-new", *ec, "-keyout", certs.key, "-out", csr, "-subj", "/CN=kubefake")
    _openssl("x509", "-req", "-in", csr, "-CA", certs.ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1",
             "-out", certs.cert, "-extfile", directory / "server.ext")
    return certs


def _config(directory: Path, extensions: str) -> Path:
    """An openssl config whose [v3] section is `extensions` (req -x509 takes no -extfile)."""
    path = directory / f"{extensions}.cnf"
    path.write_text("[req]\ndistinguished_name=dn\n[dn]\n[v3]\n" + (directory / extensions).read_text())
    return path


def _openssl(*args: object) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)
