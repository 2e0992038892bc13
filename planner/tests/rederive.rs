//! A plan file is checked against its recorded specs: every derived field, changed alone,
//! is refused naming its JSON path; an edited schedule that does the planned work and passes
//! the verifier is accepted; one that does other work is refused.

mod common;

use common::parallel;
use serde_json::Value;
use shardplan_ir::{differentiate, JointGraph};
use shardplan_models::{preset, trace, TraceOptions};
use shardplan_planner::rederive::{check_parallel, rederive, Refusal};
use shardplan_planner::{plan, Plan, PlanSource};

const SPEC: &str = "mesh: {shard: 4}\ngpus_per_node: 4\nmixed_precision: {param: f32, reduce: f32}\nbatch: {per_rank: 2, seq_len: 16}\n";

fn joint_for(yaml: &str) -> (JointGraph, shardplan_frontends::ParallelConfig) {
    let config = parallel(yaml);
    let g = trace(
        &preset("tiny-llama").unwrap(),
        TraceOptions {
            batch: config.batch.per_rank,
            seq_len: config.batch.seq_len,
            dtype: config.mixed_precision.param,
            ..Default::default()
        },
    )
    .unwrap();
    (differentiate(&g).unwrap(), config)
}

fn plan_for(yaml: &str) -> (Plan, JointGraph) {
    let (joint, config) = joint_for(yaml);
    let mut p = plan(&joint, &config).unwrap();
    p.source = Some(PlanSource {
        model: preset("tiny-llama").unwrap(),
        parallel: config,
    });
    (p, joint)
}

/// Checks `file` as `train --plan` does after parsing it.
fn check(file: &Value, joint: &JointGraph) -> Result<(), Refusal> {
    let plan: Plan = match serde_json::from_value(file.clone()) {
        Ok(p) => p,
        Err(e) => {
            return Err(Refusal::Source {
                path: "(type)".into(),
                message: e.to_string(),
                help: String::new(),
            })
        }
    };
    rederive(file, &plan, joint)
}

/// Every leaf below `v`, as (JSON path, value).
fn leaves(v: &Value, path: String, out: &mut Vec<(String, Value)>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                leaves(x, p, out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                leaves(x, format!("{path}[{i}]"), out);
            }
        }
        _ => out.push((path, v.clone())),
    }
}

fn set(v: &mut Value, path: &str, new: Value) {
    let mut cur = v;
    for part in path.split('.') {
        let (key, idx) = match part.find('[') {
            Some(i) => (&part[..i], Some(&part[i..])),
            None => (part, None),
        };
        cur = &mut cur[key];
        if let Some(idx) = idx {
            for n in idx.trim_start_matches('[').trim_end_matches(']').split("][") {
                cur = &mut cur[n.parse::<usize>().unwrap()];
            }
        }
    }
    *cur = new;
}

#[test]
fn the_unedited_plan_is_accepted() {
    let (p, joint) = plan_for(SPEC);
    let v = serde_json::to_value(&p).unwrap();
    check(&v, &joint).unwrap();
    check_parallel(&p.source.as_ref().unwrap().parallel).unwrap();
}

#[test]
fn every_derived_field_changed_alone_is_refused_by_path() {
    let (p, joint) = plan_for(SPEC);
    let v = serde_json::to_value(&p).unwrap();
    let mut all = Vec::new();
    leaves(&v, String::new(), &mut all);
    let choice = |path: &str| {
        ["programs", "events", "source"]
            .iter()
            .any(|c| path == *c || path.starts_with(&format!("{c}.")) || path.starts_with(&format!("{c}[")))
    };
    let mut refused = 0;
    let mut checked = Vec::new();
    for (path, leaf) in all.iter().filter(|(p, _)| !choice(p)) {
        let new = match leaf {
            Value::Number(n) if n.is_f64() => Value::from(n.as_f64().unwrap() * 1.5 + 1.0),
            Value::Number(n) => Value::from(n.as_u64().unwrap_or(0) + 1),
            Value::String(s) => Value::from(format!("{s}x")),
            Value::Bool(b) => Value::from(!b),
            Value::Null => Value::from(1u64),
            _ => unreachable!(),
        };
        let mut m = v.clone();
        set(&mut m, path, new);
        match check(&m, &joint) {
            Ok(()) => panic!("`{path}` changed from {leaf} was accepted"),
            // The typed reader refuses values of the wrong kind (an enum's name, a float in an
            // integer field) before re-derivation.
            Err(Refusal::Source { path: t, .. }) if t == "(type)" => {}
            Err(Refusal::Derived { path: found, .. }) => {
                assert_eq!(&found, path, "changing `{path}` was refused at another path");
                refused += 1;
                checked.push(path.clone());
            }
            // FSDP2's hooks are derived from the program.
            Err(Refusal::Hooks { path: found, .. }) if path.starts_with("fsdp2_hooks.") => {
                assert_eq!(&found, path, "changing `{path}` was refused at another path");
                refused += 1;
                checked.push(path.clone());
            }
            Err(e) => panic!("`{path}`: unexpected refusal {e}"),
        }
    }
    // The fields the issue names are among them.
    for must in [
        "groups[1].layout.params[2].shard_offset",
        "groups[1].layout.shard_numel",
        "groups[1].params[0]",
        "buffers[3].numel",
        "mesh.shard",
        "memory.peak",
        "timing.end[5]",
        "fsdp2_hooks.hooks.forward[0][1][0]",
        "fsdp2_hooks.hooks.backward[2][0]",
    ] {
        assert!(checked.iter().any(|c| c == must), "{must} was not checked");
    }
    assert!(refused > 300, "only {refused} derived fields checked");
}

#[test]
fn swapped_and_duplicated_entries_are_refused() {
    let (p, joint) = plan_for(SPEC);
    let v = serde_json::to_value(&p).unwrap();
    let mut m = v.clone();
    let params = m["groups"][1]["layout"]["params"].as_array_mut().unwrap();
    params.swap(0, 1);
    let e = check(&m, &joint).unwrap_err();
    assert_eq!(e.path(), "groups[1].layout.params[0].dims", "{e}");

    let mut m = v.clone();
    let params = m["groups"][1]["params"].as_array_mut().unwrap();
    params.swap(0, 1);
    let e = check(&m, &joint).unwrap_err();
    assert_eq!(e.path(), "groups[1].params[0]", "{e}");

    let mut m = v.clone();
    let b = m["buffers"][2].clone();
    m["buffers"].as_array_mut().unwrap().push(b);
    let e = check(&m, &joint).unwrap_err();
    assert_eq!(e.path(), "buffers", "{e}");
    assert!(e.to_string().contains("entries"), "{e}");
}

/// The plan of `SPEC` with the program of a deeper prefetch (and its simulation) written in.
fn deeper_prefetch() -> (Value, JointGraph) {
    let (p1, joint) = plan_for(SPEC);
    let (p2, _) = plan_for(&format!("{SPEC}prefetch: {{forward: 2, backward: 2}}\n"));
    assert_ne!(p1.programs, p2.programs, "prefetch 2 changes the program");
    (common::edit::with_schedule_of(&p1, &p2), joint)
}

#[test]
fn an_edited_schedule_the_verifier_accepts_is_accepted() {
    let (v, joint) = deeper_prefetch();
    check(&v, &joint).unwrap();
}

#[test]
fn an_edited_schedule_with_a_stale_simulation_is_refused() {
    let (mut v, joint) = deeper_prefetch();
    let (p1, _) = plan_for(SPEC);
    v["memory"] = serde_json::to_value(&p1.memory).unwrap();
    v["timing"] = serde_json::to_value(&p1.timing).unwrap();
    let e = check(&v, &joint).unwrap_err();
    assert!(matches!(e, Refusal::Simulated { .. }), "{e}");
    assert!(
        e.path().starts_with("memory.") || e.path().starts_with("timing."),
        "{e}"
    );
}

#[test]
fn fsdp2_hooks_other_than_the_programs_are_refused() {
    let (p, joint) = plan_for(SPEC);
    let v = serde_json::to_value(&p).unwrap();
    // layers.0's pre-forward prefetching the root instead of layers.1.
    let mut m = v.clone();
    assert_eq!(m["fsdp2_hooks"]["hooks"]["forward"][0], serde_json::json!([0, [1]]));
    m["fsdp2_hooks"]["hooks"]["forward"][0][1][0] = 2.into();
    let e = check(&m, &joint).unwrap_err();
    assert!(matches!(e, Refusal::Hooks { .. }), "{e}");
    assert_eq!(e.path(), "fsdp2_hooks.hooks.forward[0][1][0]", "{e}");
    assert!(
        e.to_string()
            .contains("is 2, but the plan's program (`programs`) gives 1"),
        "{e}"
    );
    // A plan recording that no hooks issue it.
    let mut m = v.clone();
    m["fsdp2_hooks"] = serde_json::json!({"refused": {"kind": "ranks", "program": 0}});
    let e = check(&m, &joint).unwrap_err();
    assert_eq!(e.path(), "fsdp2_hooks.hooks", "{e}");
    // A deeper prefetch written into the program without its hooks: the root's pre-forward
    // now gathers both blocks.
    let (mut m, joint) = deeper_prefetch();
    assert_eq!(m["fsdp2_hooks"]["hooks"]["forward"], serde_json::json!([[2, [0, 1]]]));
    m["fsdp2_hooks"] = v["fsdp2_hooks"].clone();
    let e = check(&m, &joint).unwrap_err();
    assert!(matches!(e, Refusal::Hooks { .. }), "{e}");
    assert!(e.path().starts_with("fsdp2_hooks.hooks."), "{e}");
}

#[test]
fn an_edited_schedule_doing_other_work_is_refused() {
    let (p, joint) = plan_for(SPEC);
    let v = serde_json::to_value(&p).unwrap();
    let instrs = v["programs"][0]["instrs"].as_array().unwrap().clone();
    let computes: Vec<usize> = instrs
        .iter()
        .enumerate()
        .filter(|(_, x)| x["kind"] == "compute")
        .map(|(i, _)| i)
        .collect();
    // Two compute steps swapped: every stream still does the same multiset of work, in
    // another order.
    let mut m = v.clone();
    m["programs"][0]["instrs"]
        .as_array_mut()
        .unwrap()
        .swap(computes[0], computes[1]);
    let e = check(&m, &joint).unwrap_err();
    assert!(matches!(e, Refusal::Schedule { .. }), "{e}");
    assert!(e.to_string().contains("compute stream"), "{e}");

    // A collective moved to another stream.
    let ag = instrs.iter().position(|x| x["kind"] == "all_gather").unwrap();
    let mut m = v.clone();
    m["programs"][0]["instrs"][ag]["stream"] = Value::from("reduce_scatter");
    assert!(matches!(check(&m, &joint), Err(Refusal::Schedule { .. })));

    // A free dropped.
    let free = instrs.iter().position(|x| x["kind"] == "free").unwrap();
    let mut m = v.clone();
    m["programs"][0]["instrs"].as_array_mut().unwrap().remove(free);
    let e = check(&m, &joint).unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");

    // A huge event count.
    let mut m = v.clone();
    m["events"] = Value::from(u32::MAX);
    let e = check(&m, &joint).unwrap_err();
    assert!(e.to_string().contains("events"), "{e}");

    // A wait moved before its record: the same work, but the verifier refuses it.
    let wait = instrs.iter().position(|x| x["kind"] == "wait").unwrap();
    let ev = instrs[wait]["event"].clone();
    let rec = instrs
        .iter()
        .position(|x| x["kind"] == "record" && x["event"] == ev)
        .unwrap();
    let mut m = v.clone();
    let list = m["programs"][0]["instrs"].as_array_mut().unwrap();
    let w = list.remove(wait);
    list.insert(rec, w);
    let e = check(&m, &joint).unwrap_err();
    assert!(matches!(e, Refusal::Verify(_)), "{e}");
}

#[test]
fn a_recorded_parallel_spec_out_of_bounds_is_refused_by_field() {
    let (p, _) = plan_for(SPEC);
    let good = p.source.unwrap().parallel;
    let mut c = good.clone();
    c.mesh.replicate = u64::MAX;
    let e = check_parallel(&c).unwrap_err();
    assert!(e.path().starts_with("source.parallel.mesh"), "{e}");
    let mut c = good.clone();
    c.batch.grad_accum = 0;
    assert_eq!(
        check_parallel(&c).unwrap_err().path(),
        "source.parallel.batch.grad_accum"
    );
    let mut c = good.clone();
    c.prefetch.forward = 1 << 20;
    assert_eq!(
        check_parallel(&c).unwrap_err().path(),
        "source.parallel.prefetch.forward"
    );
    let mut c = good.clone();
    c.hardware.hbm_gib = -1.0;
    assert!(check_parallel(&c)
        .unwrap_err()
        .path()
        .starts_with("source.parallel.hardware"));
    let mut c = good;
    c.grad_clip = Some(f64::INFINITY);
    assert!(check_parallel(&c).is_err());
}
