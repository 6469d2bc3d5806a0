//! The deployment files parse and reference each other consistently: the
//! Kubernetes manifests, the compose file, the Dockerfile. (No container
//! engine or cluster runs here; what can run does: the ConfigMap's settings
//! and Envoy-format config load in the real binary, and Envoy validates the
//! compose Envoy config.)

use crate::common;

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use common::process::ServeProcess;
use yaml_rust2::{Yaml, YamlLoader};

const DEPLOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy");

fn load(path: &Path) -> Vec<Yaml> {
    YamlLoader::load_from_str(&std::fs::read_to_string(path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn s(y: &Yaml) -> &str {
    y.as_str()
        .unwrap_or_else(|| panic!("expected a string, got {y:?}"))
}

fn labels(y: &Yaml) -> HashMap<String, String> {
    y.as_hash()
        .map(|h| {
            h.iter()
                .map(|(k, v)| (s(k).to_owned(), s(v).to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn kubernetes_manifests_reference_each_other() {
    let dir = Path::new(DEPLOY).join("kubernetes");
    let kustomization = &load(&dir.join("kustomization.yaml"))[0];
    let mut objects: HashMap<(String, String), Yaml> = HashMap::new();
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != "kustomization.yaml")
        .collect();
    files.sort();
    let mut listed: Vec<String> = kustomization["resources"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|r| s(r).to_owned())
        .collect();
    listed.sort();
    assert_eq!(listed, files, "kustomization lists every manifest");
    for file in &files {
        for doc in load(&dir.join(file)) {
            let key = (
                s(&doc["kind"]).to_owned(),
                s(&doc["metadata"]["name"]).to_owned(),
            );
            assert!(
                objects.insert(key.clone(), doc).is_none(),
                "duplicate {key:?}"
            );
        }
    }
    let get = |kind: &str, name: &str| {
        objects
            .get(&(kind.into(), name.into()))
            .unwrap_or_else(|| panic!("no {kind} {name}"))
    };

    let deployment = get("Deployment", "tollgate");
    let pod_labels = labels(&deployment["spec"]["template"]["metadata"]["labels"]);
    let matches = |selector: &Yaml| {
        labels(selector)
            .iter()
            .all(|(k, v)| pod_labels.get(k) == Some(v))
    };
    assert!(matches(&deployment["spec"]["selector"]["matchLabels"]));
    assert!(matches(&get("Service", "tollgate")["spec"]["selector"]));
    assert!(matches(
        &get("PodDisruptionBudget", "tollgate")["spec"]["selector"]["matchLabels"]
    ));
    let hpa = &get("HorizontalPodAutoscaler", "tollgate")["spec"]["scaleTargetRef"];
    assert_eq!(
        (s(&hpa["kind"]), s(&hpa["name"])),
        ("Deployment", "tollgate")
    );

    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let ports: HashMap<String, i64> = container["ports"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|p| {
            (
                s(&p["name"]).to_owned(),
                p["containerPort"].as_i64().unwrap(),
            )
        })
        .collect();
    for port in get("Service", "tollgate")["spec"]["ports"]
        .as_vec()
        .unwrap()
    {
        assert!(
            ports.contains_key(s(&port["targetPort"])),
            "service targets a named container port"
        );
    }
    for probe in ["startupProbe", "readinessProbe"] {
        assert_eq!(
            container[probe]["grpc"]["port"].as_i64(),
            Some(ports["grpc"]),
            "{probe} asks the gRPC port"
        );
        assert_eq!(
            s(&container[probe]["grpc"]["service"]),
            "tollgate.v1.RateLimiter"
        );
    }
    assert!(ports.contains_key(s(&container["livenessProbe"]["httpGet"]["port"])));
    assert!(pod["terminationGracePeriodSeconds"].as_i64().unwrap() >= 15);
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));

    // Every volume and secret the pod uses exists, with the keys it mounts.
    let secret = get("Secret", "tollgate-secrets");
    assert_eq!(
        s(&container["envFrom"][0]["secretRef"]["name"]),
        "tollgate-secrets"
    );
    let help = Command::new(common::process::BIN)
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for (k, _) in secret["stringData"].as_hash().unwrap() {
        assert!(
            help.contains(&format!("[env: {}", s(k))),
            "{} is a serve setting",
            s(k)
        );
    }
    for volume in pod["volumes"].as_vec().unwrap() {
        if let Some(name) = volume["configMap"]["name"].as_str() {
            get("ConfigMap", name);
        }
    }
    for mount in container["volumeMounts"].as_vec().unwrap() {
        if let Some(sub) = mount["subPath"].as_str() {
            let volume = pod["volumes"]
                .as_vec()
                .unwrap()
                .iter()
                .find(|v| s(&v["name"]) == s(&mount["name"]))
                .unwrap();
            let cm = get("ConfigMap", s(&volume["configMap"]["name"]));
            assert!(!cm["data"][sub].is_badvalue(), "ConfigMap has {sub}");
        }
    }

    // The ConfigMap's settings and Envoy config load in the real binary.
    let work = tempfile::tempdir().unwrap();
    let envoy_dir = work.path().join("envoy");
    std::fs::create_dir(&envoy_dir).unwrap();
    std::fs::write(
        envoy_dir.join("edge.yaml"),
        s(&get("ConfigMap", "tollgate-envoy")["data"]["edge.yaml"]),
    )
    .unwrap();
    let toml = s(&get("ConfigMap", "tollgate-config")["data"]["tollgate.toml"])
        .replace("0.0.0.0:50051", "127.0.0.1:0")
        .replace("0.0.0.0:8090", "127.0.0.1:0")
        .replace("/etc/tollgate/envoy", envoy_dir.to_str().unwrap());
    std::fs::write(work.path().join("tollgate.toml"), toml).unwrap();
    let server = ServeProcess::start(work.path(), &["--config", "tollgate.toml"]);
    server.wait_ready();
    let (status, logs) = server.terminate();
    assert!(status.success());
    assert!(
        logs.iter().any(|l| l.contains("tollgate stopped")),
        "{logs:#?}"
    );
}

#[test]
fn compose_file_and_dockerfile_are_consistent() {
    let deploy = Path::new(DEPLOY);
    let compose = &load(&deploy.join("compose.yaml"))[0];
    let services = compose["services"].as_hash().unwrap();
    let names: Vec<&str> = services.keys().map(s).collect();
    for want in [
        "redis",
        "tollgate-1",
        "tollgate-2",
        "tollgate-3",
        "prometheus",
        "grafana",
        "envoy",
        "upstream",
    ] {
        assert!(names.contains(&want), "compose has {want}");
    }
    for (name, service) in services {
        if let Some(deps) = service["depends_on"].as_vec() {
            for d in deps {
                assert!(
                    names.contains(&s(d)),
                    "{} depends on unknown {}",
                    s(name),
                    s(d)
                );
            }
        }
        if let Some(volumes) = service["volumes"].as_vec() {
            for v in volumes {
                let source = s(v).split(':').next().unwrap();
                assert!(deploy.join(source).exists(), "{}: {source} exists", s(name));
            }
        }
        if let Some(build) = service["build"].as_hash() {
            let build = Yaml::Hash(build.clone());
            let context = deploy.join(s(&build["context"]));
            assert!(context.join(s(&build["dockerfile"])).exists());
        }
    }
    let envoy = Command::new("envoy")
        .args(["--mode", "validate", "-c"])
        .arg(deploy.join("compose/envoy.yaml"))
        .output()
        .expect("envoy runs (scripts/test installs it)");
    assert!(
        envoy.status.success(),
        "{}",
        String::from_utf8_lossy(&envoy.stderr)
    );

    let dockerfile = std::fs::read_to_string(deploy.join("Dockerfile")).unwrap();
    let root = deploy.parent().unwrap();
    for line in dockerfile
        .lines()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from"))
    {
        let parts: Vec<&str> = line.split_whitespace().collect();
        for source in &parts[1..parts.len() - 1] {
            assert!(
                root.join(source).exists(),
                "Dockerfile copies {source}, which exists"
            );
        }
    }
    // Cargo reads the whole workspace: every member's directory is copied.
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let members = manifest
        .lines()
        .find(|l| l.starts_with("members = "))
        .expect("the workspace lists its members");
    for member in members.split('"').skip(1).step_by(2).filter(|m| *m != ".") {
        let top = member.split('/').next().unwrap();
        assert!(
            dockerfile
                .lines()
                .any(|l| l.starts_with(&format!("COPY {top} "))),
            "the Dockerfile copies the workspace member {member}"
        );
    }
    assert!(
        dockerfile.lines().any(|l| l.starts_with("USER 10001")),
        "runs as a non-root user"
    );
    assert!(
        dockerfile.contains(r#"CMD ["tollgate", "health""#),
        "health check uses tollgate health"
    );
    assert_eq!(
        dockerfile.matches("\nFROM ").count() + usize::from(dockerfile.starts_with("FROM")),
        2,
        "multi-stage"
    );
}
