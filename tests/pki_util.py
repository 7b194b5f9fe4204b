"""Certificates made for a test with openssl: a CA, a server and clients."""

import os
import subprocess


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60,
                   stdin=subprocess.DEVNULL)


def make_pki(tmp):
    """A CA, a server cert for 127.0.0.1 and two client certs (URI SANs spiffe://test/a, /b)."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.crt", cwd=tmp)

    def leaf(name, subject, san, usage):
        with open(os.path.join(tmp, f"{name}.ext"), "w") as f:
            f.write(f"subjectAltName={san}\nextendedKeyUsage={usage}\n"
                    "basicConstraints=CA:FALSE\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
                "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=tmp)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
                "-out", f"{name}.crt", cwd=tmp)

    # clientAuth too: etcd's JSON gateway calls its own gRPC port with the server certificate.
    leaf("server", "/CN=127.0.0.1", "IP:127.0.0.1,DNS:localhost", "serverAuth,clientAuth")
    leaf("client_a", "/CN=client-a", "URI:spiffe://test/a", "clientAuth")
    leaf("client_b", "/CN=client-b", "URI:spiffe://test/b", "clientAuth")
    return {"dir": tmp, **{name: os.path.join(tmp, name) for name in
            ("ca.crt", "server.crt", "server.key", "client_a.crt", "client_a.key",
             "client_b.crt", "client_b.key")}}
