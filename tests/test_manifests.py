"""The shipped deployment files: Envoy configs, docker compose, Istio manifests, Dockerfile.

No Docker and no Kubernetes here: Envoy configs go through `envoy --mode validate` (which loads
the plugin and runs its on_configure, so the plugin config is checked by the plugin itself),
the Istio manifests through the OpenAPI v3 schemas of Istio's CRDs (tests/istio-crds/), and the
compose file is read as YAML and checked field by field.
"""

import copy
import importlib.util
import json
import os
import re

import jsonschema
import pytest
import yaml

import harness
from harness import REPO_ROOT, request, validate_config
from jwt_util import istio_jwt_authn_filter, make_jwt

ENVOY_DIR = os.path.join(REPO_ROOT, "envoy")
ISTIO_DIR = os.path.join(ENVOY_DIR, "istio")
CRD_DIR = os.environ.get("IDEM_ISTIO_CRDS") or os.path.join(harness.TESTS_DIR, "istio-crds")

WASM_FILTER = "envoy.filters.http.wasm"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
STRING_VALUE_TYPE = "type.googleapis.com/google.protobuf.StringValue"
DOCKER_PLUGIN_PATH = "/etc/envoy/idempotency.wasm"
DOCKER_CONFIG_PATH = "/etc/envoy/envoy.yaml"

# The plugin config of the demo (envoy.yaml and envoy-docker.yaml), as the brief fixes it.
DEMO_PLUGIN_CONFIG = {"forward": "detached", "detached_via": "idem_internal", "lease_ms": 10000, "retention_s": 86400,
                      "capacity": 65536, "max_store_bytes": 134217728,
                      "scope_headers": ["authorization"], "missing_scope": "pass",
                      "namespace": "demo"}


# --- helpers ----------------------------------------------------------------------------


def load_yaml(path):
    with open(path) as f:
        return yaml.safe_load(f)


def wasm_filters(bootstrap):
    """Every wasm HTTP filter (the dict with name/typed_config) in a static bootstrap."""
    found = []
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for net in chain["filters"]:
                for http in net["typed_config"].get("http_filters", []):
                    if http["name"] == WASM_FILTER:
                        found.append(http)
    return found


def the_plugin(bootstrap):
    """The one wasm filter's PluginConfig (typed_config.config)."""
    filters = wasm_filters(bootstrap)
    assert len(filters) == 1, f"expected one wasm filter, found {len(filters)}"
    assert filters[0]["typed_config"]["@type"] == WASM_TYPE
    return filters[0]["typed_config"]["config"]


def plugin_json(plugin):
    configuration = plugin["configuration"]
    assert configuration["@type"] == STRING_VALUE_TYPE
    return json.loads(configuration["value"])


def set_plugin_json(plugin, config):
    plugin["configuration"]["value"] = json.dumps(config)


def envoy_validate(bootstrap):
    ok, output = validate_config(yaml.safe_dump(bootstrap, sort_keys=False))
    return ok, output


def assert_valid(bootstrap, what):
    ok, output = envoy_validate(bootstrap)
    assert ok, f"{what} fails envoy --mode validate:\n{harness.tail(output)}"


def with_local_wasm(bootstrap, expected_filename):
    """A copy whose wasm filter loads the built plugin (harness.wasm_path(), absolute)."""
    copy_ = copy.deepcopy(bootstrap)
    local = the_plugin(copy_)["vm_config"]["code"]["local"]
    assert local["filename"] == expected_filename
    local["filename"] = harness.wasm_path()
    return copy_


def outer_listeners(bootstrap):
    """The listeners with an address; the others are internal (`detached_via`)."""
    return [lst for lst in bootstrap["static_resources"]["listeners"] if "address" in lst]


def listener_address(bootstrap):
    (listener,) = outer_listeners(bootstrap)
    sa = listener["address"]["socket_address"]
    return sa["address"], sa["port_value"]


def admin_address(bootstrap):
    sa = bootstrap["admin"]["address"]["socket_address"]
    return sa["address"], sa["port_value"]


def cluster_endpoint(bootstrap, name):
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    cluster = clusters[name]
    (locality,) = cluster["load_assignment"]["endpoints"]
    (endpoint,) = locality["lb_endpoints"]
    sa = endpoint["endpoint"]["address"]["socket_address"]
    return cluster["type"], sa["address"], sa["port_value"]


def route_of(bootstrap):
    (listener,) = outer_listeners(bootstrap)
    (chain,) = listener["filter_chains"]
    (hcm,) = chain["filters"]
    (vhost,) = hcm["typed_config"]["route_config"]["virtual_hosts"]
    (route,) = vhost["routes"]
    return route["route"]


def http_filter_names(bootstrap):
    (listener,) = outer_listeners(bootstrap)
    (chain,) = listener["filter_chains"]
    (hcm,) = chain["filters"]
    return [f["name"] for f in hcm["typed_config"]["http_filters"]]


def makefile_envoy_version():
    with open(os.path.join(REPO_ROOT, "Makefile")) as f:
        match = re.search(r"^ENVOY_VERSION\s*:=\s*(\S+)", f.read(), re.M)
    assert match, "Makefile has no ENVOY_VERSION"
    return match.group(1)


@pytest.fixture(scope="module")
def envoy_yaml_doc():
    return load_yaml(os.path.join(ENVOY_DIR, "envoy.yaml"))


@pytest.fixture(scope="module")
def docker_yaml_doc():
    return load_yaml(os.path.join(ENVOY_DIR, "envoy-docker.yaml"))


COMPOSE_VARIABLE = re.compile(r"\$\{([A-Z_][A-Z0-9_]*):-([^}]*)\}")


def compose_defaults(node):
    """A compose file as Compose reads it with none of its variables set: `${NAME:-default}`
    is the default."""
    if isinstance(node, dict):
        return {key: compose_defaults(value) for key, value in node.items()}
    if isinstance(node, list):
        return [compose_defaults(value) for value in node]
    if isinstance(node, str):
        return COMPOSE_VARIABLE.sub(lambda m: m.group(2), node)
    return node


@pytest.fixture(scope="module")
def compose_raw():
    return load_yaml(os.path.join(ENVOY_DIR, "docker-compose.yaml"))


@pytest.fixture(scope="module")
def compose(compose_raw):
    return compose_defaults(compose_raw)


def test_compose_files_run_with_compose_v1_and_v2_and_name_their_images():
    """No top-level `name:` (docker-compose 1.29 refuses it), and every image a variable whose
    default is the published image (tests/test_compose.py names local ones)."""
    for file in ("docker-compose.yaml", "docker-compose-fleet.yaml"):
        doc = load_yaml(os.path.join(ENVOY_DIR, file))
        assert set(doc) - {"services", "networks", "volumes"} <= {
            k for k in doc if k.startswith("x-")}, (file, set(doc))
        for name, service in doc["services"].items():
            match = COMPOSE_VARIABLE.fullmatch(service["image"])
            assert match and match.group(1).endswith("_IMAGE"), (file, name, service["image"])


ISTIO_FILES = ("wasmplugin.yaml", "envoyfilter-stop-iteration.yaml")
INTERNAL_ROUTER = "idempotency-internal-router"
# Objects kept commented out in a manifest, every line starting "#>" (wasmplugin.yaml must stay
# one YAML document), read as `sed -n 's/^#> \{0,1\}//p' <file>` hands them to kubectl.
COMPANION_LINE = re.compile(r"^#> ?")


def manifest_documents(filename):
    """(documents, companions): the objects of an Istio manifest, and those in its "#>" lines."""
    with open(os.path.join(ISTIO_DIR, filename)) as f:
        text = f.read()
    documents = [d for d in yaml.safe_load_all(text) if d is not None]
    companion = "".join(COMPANION_LINE.sub("", line, count=1)
                        for line in text.splitlines(True) if COMPANION_LINE.match(line))
    return documents, [d for d in yaml.safe_load_all(companion) if d is not None]


def the_object(documents, kind, name):
    (found,) = [d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


@pytest.fixture(scope="module")
def wasmplugin():
    return the_object(manifest_documents("wasmplugin.yaml")[0], "WasmPlugin", "idempotency")


@pytest.fixture(scope="module")
def envoyfilter():
    return the_object(manifest_documents("envoyfilter-stop-iteration.yaml")[0], "EnvoyFilter",
                      "idempotency")


@pytest.fixture(scope="module")
def internal_router():
    return the_object(manifest_documents("envoyfilter-stop-iteration.yaml")[0], "EnvoyFilter",
                      INTERNAL_ROUTER)


# --- a. the Envoy configs pass envoy --mode validate --------------------------------------


def test_demo_config_validates(wasm, envoy_yaml_doc):
    # make run starts Envoy at the repository root, where this relative path names the plugin.
    assert os.path.join(REPO_ROOT, "dist", "idempotency.wasm") == os.path.join(
        REPO_ROOT, the_plugin(envoy_yaml_doc)["vm_config"]["code"]["local"]["filename"])
    assert_valid(with_local_wasm(envoy_yaml_doc, "dist/idempotency.wasm"), "envoy/envoy.yaml")


def test_docker_config_validates_with_local_paths(wasm, docker_yaml_doc):
    bootstrap = with_local_wasm(docker_yaml_doc, DOCKER_PLUGIN_PATH)
    kind, host, port = cluster_endpoint(bootstrap, "demo_upstream")
    assert (kind, host, port) == ("STRICT_DNS", "upstream", 8080)
    for cluster in bootstrap["static_resources"]["clusters"]:
        for locality in cluster["load_assignment"]["endpoints"]:
            for endpoint in locality["lb_endpoints"]:
                address = endpoint["endpoint"]["address"]
                if "socket_address" in address:
                    address["socket_address"]["address"] = "127.0.0.1"
    assert_valid(bootstrap, "envoy/envoy-docker.yaml")


def test_bad_plugin_config_fails_validation_and_names_the_field(wasm, envoy_yaml_doc):
    bootstrap = with_local_wasm(envoy_yaml_doc, "dist/idempotency.wasm")
    plugin = the_plugin(bootstrap)
    config = plugin_json(plugin)
    config["lease_ms"] = "soon"
    set_plugin_json(plugin, config)
    ok, output = envoy_validate(bootstrap)
    assert not ok, "a plugin config with lease_ms: \"soon\" passed validation"
    assert "lease_ms" in output, harness.tail(output)


def test_demo_config_is_what_the_demo_expects(envoy_yaml_doc):
    plugin = the_plugin(envoy_yaml_doc)
    assert plugin["name"] == "idempotency" and plugin["root_id"] == "idempotency"
    assert plugin["vm_config"]["vm_id"] == "idempotency"
    assert plugin["vm_config"]["runtime"] == "envoy.wasm.runtime.v8"
    assert plugin_json(plugin) == DEMO_PLUGIN_CONFIG
    assert plugin["allow_on_headers_stop_iteration"] is True
    assert plugin["failure_policy"] == "FAIL_CLOSED"
    assert plugin.get("fail_open", False) is False
    assert http_filter_names(envoy_yaml_doc) == [WASM_FILTER, "envoy.filters.http.router"]
    assert route_of(envoy_yaml_doc) == {"cluster": "demo_upstream", "timeout": "30s"}

    demo = load_demo_module()
    assert admin_address(envoy_yaml_doc) == (demo.HOST, demo.ADMIN_PORT) == ("127.0.0.1", 9901)
    assert listener_address(envoy_yaml_doc) == (demo.HOST, demo.LISTENER_PORT)
    assert demo.LISTENER_PORT == 10000
    assert cluster_endpoint(envoy_yaml_doc, "demo_upstream") == (
        "STATIC", demo.HOST, demo.UPSTREAM_PORT)
    assert demo.UPSTREAM_PORT == 8080


def test_docker_config_matches_the_demo_config(envoy_yaml_doc, docker_yaml_doc):
    local, docker = the_plugin(envoy_yaml_doc), the_plugin(docker_yaml_doc)
    assert plugin_json(docker) == plugin_json(local)
    for field in ("name", "root_id", "allow_on_headers_stop_iteration", "failure_policy"):
        assert docker[field] == local[field], field
    assert docker["vm_config"]["vm_id"] == local["vm_config"]["vm_id"]
    assert route_of(docker_yaml_doc) == route_of(envoy_yaml_doc)
    assert http_filter_names(docker_yaml_doc) == http_filter_names(envoy_yaml_doc)
    # Published ports reach a container through its own interface, not its loopback.
    assert listener_address(docker_yaml_doc) == ("0.0.0.0", 10000)
    assert admin_address(docker_yaml_doc) == ("0.0.0.0", 9901)


@pytest.mark.parametrize("name", ["envoy.yaml", "envoy-docker.yaml", "envoy-fleet.yaml",
                                  "envoy-fleet-docker.yaml", "envoy-grpc.yaml"])
def test_detached_calls_go_through_an_internal_listener_with_the_same_routes(name):
    """docs/deployment.md: the plugin's `detached_via` names a cluster whose one endpoint is
    an internal listener whose connection manager has the plugin's listener's routes and the
    router only, and the bootstrap has the internal listener extension."""
    bootstrap = load_yaml(os.path.join(ENVOY_DIR, name))
    assert [e["name"] for e in bootstrap.get("bootstrap_extensions", [])] == [
        "envoy.bootstrap.internal_listener"]
    via = plugin_json(the_plugin(bootstrap))["detached_via"]
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    (locality,) = clusters[via]["load_assignment"]["endpoints"]
    (endpoint,) = locality["lb_endpoints"]
    inner = endpoint["endpoint"]["address"]["envoy_internal_address"]["server_listener_name"]
    listeners = {lst["name"]: lst for lst in bootstrap["static_resources"]["listeners"]}
    assert "internal_listener" in listeners[inner] and "address" not in listeners[inner]
    (chain,) = listeners[inner]["filter_chains"]
    (hcm,) = chain["filters"]
    names = [f["name"] for f in hcm["typed_config"]["http_filters"]]
    assert names == ["envoy.filters.http.router"], "no idempotency filter on the hop"
    outer = outer_listeners(bootstrap)[0]
    outer_hcm = outer["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["typed_config"]["route_config"] == outer_hcm["route_config"], "the same routes"


def load_demo_module():
    spec = importlib.util.spec_from_file_location("idem_demo", os.path.join(ENVOY_DIR,
                                                                             "demo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # only definitions: main() runs under __main__ only
    return module


# --- b. the Istio manifests against Istio's CRD schemas -----------------------------------


def int_format(bits):
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return lambda v: not isinstance(v, int) or isinstance(v, bool) or low <= v <= high


FORMATS = jsonschema.FormatChecker(formats=())
FORMATS.checks("int32")(int_format(32))
FORMATS.checks("int64")(int_format(64))
FORMATS.checks("date-time")(lambda v: not isinstance(v, str) or re.fullmatch(
    r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", v) is not None)

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def openapi_to_jsonschema(node):
    """A CRD's OpenAPI v3 schema node as JSON Schema (draft 4), the way the API server reads it.

    - `x-kubernetes-*` extensions are dropped. Their CEL rules (x-kubernetes-validations)
      cannot be evaluated here; the tests check the few that matter by hand.
    - `nullable: true` admits null.
    - An object with `properties` and neither `additionalProperties` nor
      `x-kubernetes-preserve-unknown-fields` admits no other field: the API server prunes
      unknown fields, and `kubectl apply` (strict field validation) rejects them. So a typo
      (`failStratgy`) fails here as it would there.
    - `format: int32/int64` are range checks (see FORMATS); descriptions are dropped.
    """
    if isinstance(node, list):
        return [openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("description", "nullable", "example"):
            continue
        if key == "properties":
            out[key] = {name: openapi_to_jsonschema(s) for name, s in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = openapi_to_jsonschema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [openapi_to_jsonschema(s) for s in value]
        else:
            out[key] = value
    if node.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = list(out["enum"]) + [None]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def crd_validator(filename):
    """(Validator, apiVersion, kind) for the served version of a CRD in CRD_DIR."""
    crd = load_yaml(os.path.join(CRD_DIR, filename))
    spec = crd["spec"]
    served = [v for v in spec["versions"] if v.get("served")]
    assert len(served) == 1, f"{filename}: expected one served version"
    version = served[0]
    api_version = f"{spec['group']}/{version['name']}"
    kind = spec["names"]["kind"]
    schema = openapi_to_jsonschema(version["schema"]["openAPIV3Schema"])
    # The API server checks these itself; the CRD's schema leaves them out.
    schema["properties"].update({
        "apiVersion": {"type": "string", "enum": [api_version]},
        "kind": {"type": "string", "enum": [kind]},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "maxLength": 253, "pattern": DNS_SUBDOMAIN},
                "namespace": {"type": "string", "maxLength": 63, "pattern": DNS_LABEL},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
    })
    schema["required"] = ["apiVersion", "kind", "metadata"] + list(schema.get("required", []))
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema, format_checker=FORMATS), api_version, kind


@pytest.fixture(scope="module")
def wasmplugin_validator():
    return crd_validator("wasmplugins.extensions.istio.io.yaml")[0]


@pytest.fixture(scope="module")
def envoyfilter_validator():
    return crd_validator("envoyfilters.networking.istio.io.yaml")[0]


def schema_errors(validator, doc):
    return ["/".join(map(str, e.absolute_path)) + ": " + e.message
            for e in validator.iter_errors(doc)]


def test_wasmplugin_matches_the_crd_schema(wasmplugin_validator, wasmplugin):
    assert schema_errors(wasmplugin_validator, wasmplugin) == []


def test_envoyfilter_matches_the_crd_schema(envoyfilter_validator, envoyfilter):
    assert schema_errors(envoyfilter_validator, envoyfilter) == []


def test_istio_manifests_hold_these_objects():
    """wasmplugin.yaml stays ONE YAML document (tests/test_scope.py reads it with safe_load),
    its internal router commented out; envoyfilter-stop-iteration.yaml has both as documents;
    the internal router is the same object in both."""
    def names(objects):
        return [(d["kind"], d["metadata"]["name"]) for d in objects]
    wp_documents, wp_companions = manifest_documents("wasmplugin.yaml")
    ef_documents, ef_companions = manifest_documents("envoyfilter-stop-iteration.yaml")
    assert names(wp_documents) == [("WasmPlugin", "idempotency")]
    assert names(wp_companions) == [("EnvoyFilter", INTERNAL_ROUTER)]
    assert names(ef_documents) == [("EnvoyFilter", "idempotency"), ("EnvoyFilter", INTERNAL_ROUTER)]
    assert ef_companions == []
    assert wp_companions[0] == ef_documents[1]


@pytest.mark.parametrize("filename", ISTIO_FILES)
def test_every_istio_object_matches_its_crd_schema(wasmplugin_validator, envoyfilter_validator,
                                                   filename):
    validators = {"WasmPlugin": wasmplugin_validator, "EnvoyFilter": envoyfilter_validator}
    documents, companions = manifest_documents(filename)
    for doc in documents + companions:
        assert doc.get("kind") in validators, (filename, doc.get("kind"))
        assert schema_errors(validators[doc["kind"]], doc) == [], (filename, doc["metadata"])


def set_path(doc, path, value):
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


@pytest.mark.parametrize("path,value,field", [
    (("spec", "failStrategy"), 3, "failStrategy"),
    (("spec", "failStrategy"), "FAIL_SOMETIMES", "failStrategy"),
    (("spec", "phase"), 7, "phase"),
    (("spec", "priority"), "high", "priority"),
    (("spec", "priority"), 2 ** 40, "priority"),          # format: int32
    (("spec", "sha256"), "abc", "sha256"),                 # pattern
    (("spec", "match", 0, "mode"), "INBOUND", "mode"),
    (("spec", "match", 0, "ports"), [{"number": 70000}], "number"),
    (("spec", "failStratgy"), "FAIL_CLOSE", "failStratgy"),  # unknown field: strict
    (("spec", "pluginConfig"), "lease_ms=1", "pluginConfig"),
    (("kind",), "WasmPlugins", "kind"),
    (("apiVersion",), "extensions.istio.io/v1", "apiVersion"),
])
def test_broken_wasmplugin_fails_the_schema(wasmplugin_validator, wasmplugin, path, value,
                                            field):
    broken = copy.deepcopy(wasmplugin)
    set_path(broken, path, value)
    errors = schema_errors(wasmplugin_validator, broken)
    assert errors, f"{path} = {value!r} passed the schema"
    assert any(field in e for e in errors), errors


def test_wasmplugin_without_url_fails_the_schema(wasmplugin_validator, wasmplugin):
    broken = copy.deepcopy(wasmplugin)
    del broken["spec"]["url"]
    assert any("url" in e for e in schema_errors(wasmplugin_validator, broken))


@pytest.mark.parametrize("path,value,field", [
    (("spec", "priority"), "high", "priority"),
    (("spec", "configPatches", 0, "applyTo"), "EXTENSION", "applyTo"),
    (("spec", "configPatches", 1, "patch", "operation"), "PREPEND", "operation"),
    (("spec", "configPatches", 1, "match", "context"), 3, "context"),
    (("spec", "configPatches", 1, "match", "listener", "portNumber"), "https", "portNumber"),
    (("spec", "configPatches", 1, "patch", "value"), "name: x", "value"),
    (("spec", "workloadSelector", "labels"), ["istio"], "labels"),
    (("spec", "configPatchez"), [], "configPatchez"),
])
def test_broken_envoyfilter_fails_the_schema(envoyfilter_validator, envoyfilter, path, value,
                                             field):
    broken = copy.deepcopy(envoyfilter)
    set_path(broken, path, value)
    errors = schema_errors(envoyfilter_validator, broken)
    assert errors, f"{path} = {value!r} passed the schema"
    assert any(field in e for e in errors), errors


def test_envoyfilter_match_oneof_is_enforced(envoyfilter_validator, envoyfilter):
    # The CRD allows at most one of listener/routeConfiguration/cluster/waypoint per match.
    broken = copy.deepcopy(envoyfilter)
    broken["spec"]["configPatches"][1]["match"]["cluster"] = {"name": "x"}
    assert schema_errors(envoyfilter_validator, broken)


def test_wasmplugin_rules_the_schema_cannot_express(wasmplugin):
    spec = wasmplugin["spec"]
    # CEL: only one of targetRefs, targetRef or selector.
    assert sum(k in spec for k in ("selector", "targetRef", "targetRefs")) <= 1
    # CEL: url scheme in [http, https, file, oci].
    assert spec["url"].split("://", 1)[0] in ("http", "https", "file", "oci")
    # What this deployment chose (see the comments in the file).
    assert spec["selector"]["matchLabels"] == {"istio": "ingressgateway"}
    assert spec["phase"] == "STATS"  # after Istio's authn AND authz filters
    assert spec["failStrategy"] == "FAIL_CLOSE"
    assert spec["pluginName"] == "idempotency"
    assert spec.get("type", "HTTP") == "HTTP"
    # Istio matches a gateway's listeners as CLIENT: SERVER alone would never apply there.
    assert {m.get("mode", "UNDEFINED") for m in spec.get("match", [])} <= {
        "CLIENT", "CLIENT_AND_SERVER", "UNDEFINED"}


def test_wasmplugin_config_parses_with_the_plugin(wasm, wasmplugin):
    # Istio sends pluginConfig as the JSON of a protobuf Struct: what json.dumps gives here,
    # for the whole numbers it holds.
    config = wasmplugin["spec"]["pluginConfig"]
    ok, output = validate_config(harness.envoy_yaml(10000, 9901, 8080, config))
    assert ok, f"the WasmPlugin's pluginConfig is refused by the plugin:\n{harness.tail(output)}"
    broken = dict(config, lease_ms="soon")
    ok, output = validate_config(harness.envoy_yaml(10000, 9901, 8080, broken))
    assert not ok and "lease_ms" in output


def envoyfilter_patches(envoyfilter):
    return {p["applyTo"]: p for p in envoyfilter["spec"]["configPatches"]}


def test_envoyfilter_is_the_wasmplugin_with_the_flag(envoyfilter, wasmplugin):
    spec = envoyfilter["spec"]
    patches = envoyfilter_patches(envoyfilter)
    assert set(patches) == {"EXTENSION_CONFIG", "HTTP_FILTER"}
    assert spec["workloadSelector"]["labels"] == wasmplugin["spec"]["selector"]["matchLabels"]
    assert envoyfilter["metadata"]["namespace"] == wasmplugin["metadata"]["namespace"]

    ext = patches["EXTENSION_CONFIG"]["patch"]
    assert ext["operation"] == "ADD"  # the only operation istiod applies to EXTENSION_CONFIG
    assert ext["value"]["typed_config"]["@type"] == WASM_TYPE
    plugin = ext["value"]["typed_config"]["config"]
    assert plugin["allow_on_headers_stop_iteration"] is True
    assert plugin["failure_policy"] == "FAIL_CLOSED"
    assert plugin["root_id"] == wasmplugin["spec"]["pluginName"]
    remote = plugin["vm_config"]["code"]["remote"]
    assert remote["http_uri"]["uri"] == wasmplugin["spec"]["url"]
    assert remote["sha256"] == wasmplugin["spec"]["sha256"]
    # One plugin configuration, in two files.
    assert plugin_json(plugin) == wasmplugin["spec"]["pluginConfig"]

    flt = patches["HTTP_FILTER"]
    assert flt["match"]["context"] == "GATEWAY"
    assert flt["patch"]["operation"] == "INSERT_BEFORE"
    hcm = flt["match"]["listener"]["filterChain"]["filter"]
    assert hcm["name"] == "envoy.filters.network.http_connection_manager"
    assert hcm["subFilter"]["name"] == "envoy.filters.http.router"
    discovery = flt["patch"]["value"]["config_discovery"]
    # Envoy subscribes to the ECDS resource named like the filter.
    assert flt["patch"]["value"]["name"] == ext["value"]["name"]
    assert WASM_TYPE in discovery["type_urls"]
    # istio-agent's replacement when the module cannot be fetched (deny-all, fail closed).
    assert "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC" in discovery[
        "type_urls"]


def added(objects, apply_to):
    """{name: (EnvoyFilter, patch)} of the ADD patches of `apply_to` among objects."""
    return {p["patch"]["value"]["name"]: (d, p) for d in objects if d["kind"] == "EnvoyFilter"
            for p in d["spec"]["configPatches"]
            if p["applyTo"] == apply_to and p["patch"]["operation"] == "ADD"}


@pytest.mark.parametrize("filename", ISTIO_FILES)
def test_detached_via_names_a_cluster_the_manifests_add(filename):
    """The plugin's `detached_via` is a cluster an EnvoyFilter of the same file adds, for the
    same workloads, whose endpoint is an internal listener it adds too: the gateway's routes
    over RDS and the router only (the plugin is not on it)."""
    documents, companions = manifest_documents(filename)
    objects = documents + companions
    (plugin,) = [d for d in documents if d["metadata"]["name"] == "idempotency"]
    if plugin["kind"] == "WasmPlugin":
        config = plugin["spec"]["pluginConfig"]
        labels = plugin["spec"]["selector"]["matchLabels"]
        context = "GATEWAY"  # istio: ingressgateway, matched as CLIENT (tested above)
    else:
        patches = envoyfilter_patches(plugin)
        wasm_config = patches["EXTENSION_CONFIG"]["patch"]["value"]["typed_config"]["config"]
        config = plugin_json(wasm_config)
        labels = plugin["spec"]["workloadSelector"]["labels"]
        context = patches["HTTP_FILTER"]["match"]["context"]
    assert config.get("forward", "detached") == "detached"
    via = config["detached_via"]
    clusters, listeners = added(objects, "CLUSTER"), added(objects, "LISTENER")
    assert via in clusters, f"{filename}: detached_via {via!r} is not added ({sorted(clusters)})"
    owner, patch = clusters[via]
    assert owner["spec"]["workloadSelector"]["labels"] == labels
    assert owner["metadata"]["namespace"] == plugin["metadata"]["namespace"]
    assert {p["match"]["context"] for p in owner["spec"]["configPatches"]} == {context}

    cluster = patch["patch"]["value"]
    assert cluster["type"] == "STATIC" and cluster["load_assignment"]["cluster_name"] == via
    (locality,) = cluster["load_assignment"]["endpoints"]
    (endpoint,) = locality["lb_endpoints"]
    target = endpoint["endpoint"]["address"]["envoy_internal_address"]["server_listener_name"]
    assert target in listeners, f"{filename}: {via} points to {target!r}, not added"
    listener_owner, listener_patch = listeners[target]
    assert listener_owner is owner
    listener = listener_patch["patch"]["value"]
    assert "internal_listener" in listener and "address" not in listener
    (chain,) = listener["filter_chains"]
    (hcm,) = chain["filters"]
    assert hcm["name"] == "envoy.filters.network.http_connection_manager"
    assert [f["name"] for f in hcm["typed_config"]["http_filters"]] == ["envoy.filters.http.router"]
    rds = hcm["typed_config"]["rds"]
    assert rds["route_config_name"] and "ads" in rds["config_source"]


def internal_router_bootstrap(internal_router, inline_routes):
    """The internal router's listener and cluster as Envoy gets them, in a static bootstrap with
    the bootstrap extension as istio-proxy's has it (TypedStruct, buffer_size_kb 64). RDS as
    written, over ADS (validate mode does not connect), or `inline_routes`: a route_config of
    the RDS name."""
    patches = {p["applyTo"]: copy.deepcopy(p["patch"]["value"])
               for p in internal_router["spec"]["configPatches"]}
    listener, cluster = patches["LISTENER"], patches["CLUSTER"]
    upstream = "outbound|8080||api.default.svc.cluster.local"
    clusters = [cluster, harness.static_cluster(upstream, 8080),
                harness.static_cluster("xds-grpc", 15010, http2=True)]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    if inline_routes:
        name = hcm.pop("rds")["route_config_name"]
        hcm["route_config"] = {"name": name, "virtual_hosts": [{
            "name": "api", "domains": ["*"], "routes": [{
                "match": {"prefix": "/api/"},
                "route": {"cluster": upstream, "prefix_rewrite": "/", "timeout": "30s",
                          "retry_policy": {"retry_on": "connect-failure", "num_retries": 2}},
                "response_headers_to_add": [{"header": {"key": "x-added", "value": "1"},
                                             "append_action": "APPEND_IF_EXISTS_OR_ADD"}]}]}]}
    return {
        "bootstrap_extensions": [{"name": "envoy.bootstrap.internal_listener", "typed_config": {
            "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
            "type_url": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3."
                        "InternalListener",
            "value": {"buffer_size_kb": 64}}}],
        "node": {"id": "router~10.0.0.1~gw.istio-system~istio-system.svc.cluster.local",
                 "cluster": "istio-ingressgateway"},
        "dynamic_resources": {"ads_config": {
            "api_type": "GRPC", "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]}},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }


@pytest.mark.parametrize("inline_routes", [False, True])
def test_internal_router_validates_in_envoy(internal_router, inline_routes):
    assert_valid(internal_router_bootstrap(internal_router, inline_routes),
                 f"the internal router (inline routes: {inline_routes})")


def test_internal_router_needs_the_bootstrap_extension(internal_router):
    # What istio-proxy's bootstrap provides (Istio >= 1.16): without it Envoy refuses the listener.
    bootstrap = internal_router_bootstrap(internal_router, True)
    del bootstrap["bootstrap_extensions"]
    ok, output = envoy_validate(bootstrap)
    assert not ok and "InternalListener bootstrap extension is mandatory" in output, \
        harness.tail(output)


def agent_rewritten(envoyfilter):
    """The EnvoyFilter's ECDS resource and HTTP filter as Envoy gets them from istio-agent:
    the oci:// module fetched and named by a local path (here the built plugin)."""
    patches = envoyfilter_patches(envoyfilter)
    ext = copy.deepcopy(patches["EXTENSION_CONFIG"]["patch"]["value"])
    ext["typed_config"]["config"]["vm_config"]["code"] = {
        "local": {"filename": harness.wasm_path()}}
    flt = copy.deepcopy(patches["HTTP_FILTER"]["patch"]["value"])
    return ext, flt


def test_envoyfilter_wasm_config_validates_in_envoy(wasm, envoyfilter):
    ext, _ = agent_rewritten(envoyfilter)
    bootstrap = harness.envoy_config(10000, 9901, 8080, None, with_plugin=False, extra_filters=[
        {"name": WASM_FILTER, "typed_config": ext["typed_config"]}])
    assert_valid(bootstrap, "the EnvoyFilter's Wasm config")


def test_envoyfilter_serves_the_plugin_over_ecds(wasm, upstream, envoyfilter, tmp_path):
    """The two patches wired as in a gateway, with ECDS from a file instead of istiod: a
    covered POST with a body is claimed and replayed (it hangs without the flag). With the
    internal listener and cluster that `detached_via` names (the harness's, same routes)."""
    ext, flt = agent_rewritten(envoyfilter)
    ecds = tmp_path / "ecds.yaml"
    ecds.write_text(json.dumps({"resources": [
        {"@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig", **ext}]}))
    source = flt["config_discovery"]["config_source"]
    del source["ads"]
    source["path_config_source"] = {"path": str(ecds)}
    port, admin_port = harness.free_port(), harness.free_port()
    # As in a gateway: Istio's jwt_authn (RequestAuthentication) before the plugin.
    bootstrap = harness.envoy_config(port, admin_port, upstream.port, None, with_plugin=False,
                                     extra_filters=[istio_jwt_authn_filter(), flt],
                                     node={"id": "gateway", "cluster": "gateway"},  # ECDS needs it
                                     internal_router=True)
    envoy = harness.Envoy(None, upstream.port, bootstrap=bootstrap, log_level="warning")
    try:
        headers = {"Idempotency-Key": "gw-1", "content-type": "application/json",
                   "authorization": f"Bearer {make_jwt('alice')}"}
        first = request(port, "POST", "/payments", headers, b'{"amount": 1}', timeout=10)
        again = request(port, "POST", "/payments", headers, b'{"amount": 1}', timeout=10)
        stats = request(admin_port, "GET", "/stats?filter=extension_config_discovery").text
    finally:
        envoy.stop()
    assert first.status == 201 and first.header("idempotent-replayed") is None
    assert again.status == 201 and again.header("idempotent-replayed") == "true"
    assert again.body == first.body
    assert upstream.effects("gw-1") == 1
    assert f"http_filter.{ext['name']}.update_success: 1" in stats, stats


# --- c. docker compose ----------------------------------------------------------------


def volume_mounts(service):
    """{container path: (host path resolved from envoy/, read_only)} of a service."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):  # long syntax
            source, target = volume["source"], volume["target"]
            read_only = bool(volume.get("read_only"))
        else:
            parts = volume.split(":")
            source, target = parts[0], parts[1]
            read_only = len(parts) > 2 and "ro" in parts[2].split(",")
        mounts[target] = (os.path.normpath(os.path.join(ENVOY_DIR, source)), read_only)
    return mounts


def test_compose_runs_the_official_envoy_image_with_the_plugin(compose):
    envoy = compose["services"]["envoy"]
    image, _, tag = envoy["image"].rpartition(":")
    assert image == "envoyproxy/envoy"
    assert tag == "v1.40.0" == "v" + makefile_envoy_version()
    mounts = volume_mounts(envoy)
    assert mounts[DOCKER_PLUGIN_PATH] == (os.path.join(REPO_ROOT, "dist", "idempotency.wasm"),
                                          True)
    assert mounts[DOCKER_CONFIG_PATH] == (os.path.join(ENVOY_DIR, "envoy-docker.yaml"), True)
    if "command" in envoy:
        command = envoy["command"]
        command = command if isinstance(command, list) else command.split()
        assert command[command.index("-c") + 1] == DOCKER_CONFIG_PATH
    assert "upstream" in envoy.get("depends_on", [])


def test_compose_publishes_listener_and_admin_on_loopback_only(compose):
    ports = [str(p) for p in compose["services"]["envoy"]["ports"]]
    assert "10000:10000" in ports
    assert "127.0.0.1:9901:9901" in ports
    admin = [p for p in ports if p.rsplit(":", 1)[-1] == "9901"]
    assert admin == ["127.0.0.1:9901:9901"], "admin must not be published beyond loopback"


def test_compose_mounted_config_uses_the_mounted_plugin(compose):
    mounts = volume_mounts(compose["services"]["envoy"])
    host_config, _ = mounts[DOCKER_CONFIG_PATH]
    bootstrap = load_yaml(host_config)
    plugin = the_plugin(bootstrap)
    assert plugin["vm_config"]["code"]["local"]["filename"] == DOCKER_PLUGIN_PATH
    assert plugin["allow_on_headers_stop_iteration"] is True
    assert plugin["failure_policy"] == "FAIL_CLOSED"
    assert plugin_json(plugin) == DEMO_PLUGIN_CONFIG
    # The published container ports are the ones Envoy binds, on every interface.
    assert listener_address(bootstrap) == ("0.0.0.0", 10000)
    assert admin_address(bootstrap) == ("0.0.0.0", 9901)
    # The upstream is the compose service, by name.
    assert cluster_endpoint(bootstrap, "demo_upstream") == ("STRICT_DNS", "upstream", 8080)


def test_compose_upstream_runs_the_sample_upstream(compose):
    upstream = compose["services"]["upstream"]
    assert upstream["image"] == "python:3.12-slim"
    mounts = volume_mounts(upstream)
    (target,) = [t for t, (src, _) in mounts.items()
                 if src == os.path.join(REPO_ROOT, "tests", "upstream.py")]
    command = upstream["command"]
    command = command if isinstance(command, list) else command.split()
    assert target in command
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert command[command.index("--port") + 1] == "8080"
    assert "ports" not in upstream, "the upstream is reached through Envoy only"


# --- the image that Istio pulls --------------------------------------------------------


def test_dockerfile_is_the_compat_wasm_image():
    with open(os.path.join(REPO_ROOT, "Dockerfile")) as f:
        lines = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines == ["FROM scratch", "COPY dist/idempotency.wasm /plugin.wasm"]
