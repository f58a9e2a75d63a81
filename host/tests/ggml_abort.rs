//! ggml's abort callback on a CPU backend from the plugin: a set flag stops
//! a computation with `ggml::Error::Aborted` (through the scheduler and
//! through `Graph::compute`), a cleared one lets it run to the right result.

mod common;
use common::*;
use ggml::{Backend, Context, Sched, Type};
use sdhost::discovery::Origin;
use sdhost::manager::BackendManager;
use sdhost::registry::Registry;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const N: i64 = 128;

/// `((a·b)·2)·b` with a = all ones, b = identity: every element is 2.
fn inputs() -> (Vec<f32>, Vec<f32>) {
    let n = N as usize;
    let ones = vec![1.0; n * n];
    let eye = (0..n * n)
        .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
        .collect();
    (ones, eye)
}

/// Through a scheduler over the CPU backend alone.
fn run_sched(cpu: &Backend) -> ggml::Result<Vec<f32>> {
    let ctx = Context::new(8, 64)?;
    let (a, b) = (
        ctx.new_tensor(Type::F32, &[N, N])?,
        ctx.new_tensor(Type::F32, &[N, N])?,
    );
    a.set_input();
    b.set_input();
    let out = ctx.mul_mat(b, ctx.scale(ctx.mul_mat(b, a)?, 2.0)?)?;
    out.set_output();
    let graph = ctx.graph(out, 64)?;
    let mut sched = Sched::new(&[cpu], 64)?;
    sched.alloc(&graph)?;
    let (ones, eye) = inputs();
    a.set_f32(&ones)?;
    b.set_f32(&eye)?;
    sched.compute(&graph)?;
    out.get_f32()
}

/// Every tensor in one buffer of the backend, computed with `Graph::compute`.
fn run_graph(cpu: &Backend) -> ggml::Result<Vec<f32>> {
    let ctx = Context::new(8, 64)?;
    let (a, b) = (
        ctx.new_tensor(Type::F32, &[N, N])?,
        ctx.new_tensor(Type::F32, &[N, N])?,
    );
    let out = ctx.mul_mat(b, ctx.scale(ctx.mul_mat(b, a)?, 2.0)?)?;
    let _buffer = ctx.alloc_tensors(cpu)?;
    let (ones, eye) = inputs();
    a.set_f32(&ones)?;
    b.set_f32(&eye)?;
    ctx.graph(out, 64)?.compute(cpu)?;
    out.get_f32()
}

#[test]
fn a_set_flag_aborts_a_cpu_computation_and_a_cleared_one_does_not() {
    let reg = Registry::discover(&[(build_dir(), Origin::Flag)]);
    let m = BackendManager::new(&reg, Some(1));
    let cpu = m.get("cpu").unwrap();
    for (path, run) in [
        ("sched", run_sched as fn(&Backend) -> ggml::Result<Vec<f32>>),
        ("graph", run_graph),
    ] {
        let flag = Arc::new(AtomicBool::new(false));
        assert!(
            cpu.set_abort_flag(flag.clone()),
            "the CPU takes the callback"
        );
        let out = run(cpu).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(out.len(), (N * N) as usize);
        assert!(out.iter().all(|&v| v == 2.0), "{path}: {:?}", &out[..4]);

        flag.store(true, Ordering::SeqCst);
        let e = run(cpu).expect_err(path);
        assert!(matches!(e, ggml::Error::Aborted), "{path}: {e:?}");
        assert_eq!(e.to_string(), "computation aborted");

        flag.store(false, Ordering::SeqCst);
        assert!(run(cpu).is_ok(), "{path}: the backend works after an abort");

        // A new flag replaces the old one: setting the old one no longer stops it.
        let fresh = Arc::new(AtomicBool::new(false));
        assert!(cpu.set_abort_flag(fresh.clone()));
        flag.store(true, Ordering::SeqCst);
        assert!(run(cpu).is_ok(), "{path}: the replaced flag is not read");
        fresh.store(true, Ordering::SeqCst);
        assert!(matches!(run(cpu), Err(ggml::Error::Aborted)), "{path}");
    }
}

#[test]
fn the_manager_hands_its_flag_to_the_cpu_backend() {
    let reg = Registry::discover(&[(build_dir(), Origin::Flag)]);
    let flag = Arc::new(AtomicBool::new(true));
    let m = BackendManager::new(&reg, Some(1)).with_abort_flag(flag.clone());
    let cpu = m.get("cpu").unwrap();
    assert!(matches!(run_sched(cpu), Err(ggml::Error::Aborted)));
    flag.store(false, Ordering::SeqCst);
    assert!(run_sched(cpu).is_ok());
}
