//! The warm interpreter in a real `python-numpy` guest under TCG.

use forkd_e2e::{block_on, shared_vm};

#[test]
fn numpy_is_warm_and_eval_returns_repr() {
    let vm = shared_vm("python-numpy");
    block_on(async {
        let p = vm
            .agent
            .ping(std::time::Duration::from_secs(10))
            .await
            .unwrap();
        assert!(
            p.warm_ready,
            "warm interpreter not ready: {:?}",
            p.warm_error
        );
        assert!(
            p.numpy_version.is_some(),
            "numpy was not imported at warm-up"
        );
        let r = vm
            .agent
            .eval("numpy.zeros(5).tolist()", None)
            .await
            .unwrap();
        assert_eq!(
            r.result.as_deref(),
            Some("[0.0, 0.0, 0.0, 0.0, 0.0]"),
            "{r:?}"
        );
        assert!(r.error.is_none());
    });
}

#[test]
fn exceptions_come_back_with_their_traceback() {
    let vm = shared_vm("python-numpy");
    block_on(async {
        let r = vm
            .agent
            .eval("def f():\n    return 1 / 0\nf()", None)
            .await
            .unwrap();
        assert_eq!(
            r.error.as_deref(),
            Some("ZeroDivisionError: division by zero")
        );
        let tb = r.traceback.unwrap();
        assert!(
            tb.contains("Traceback") && tb.contains("return 1 / 0"),
            "{tb}"
        );
        let r = vm.agent.eval("def (:", None).await.unwrap();
        let e = r.error.unwrap();
        assert!(e.starts_with("SyntaxError"), "{e}");
    });
}

#[test]
fn state_persists_between_evals_and_statements_work() {
    let vm = shared_vm("python-numpy");
    block_on(async {
        let r = vm
            .agent
            .eval(
                "import math\nxs = [math.sqrt(i) for i in range(4)]\nprint('hi')",
                None,
            )
            .await
            .unwrap();
        assert_eq!(r.result, None, "no trailing expression, no result");
        assert_eq!(r.stdout, "hi\n");
        let r = vm.agent.eval("len(xs), xs[1]", None).await.unwrap();
        assert_eq!(r.result.as_deref(), Some("(4, 1.0)"));
        let r = vm.agent.eval("np.arange(3).sum()", None).await.unwrap();
        // numpy 1.x prints a numpy integer as "3", numpy 2 as "np.int64(3)".
        assert!(
            matches!(r.result.as_deref(), Some("3") | Some("np.int64(3)")),
            "{r:?}"
        );
    });
}

#[test]
fn eval_timeout_restarts_the_interpreter() {
    // Its own VM: a restart loses state other tests rely on.
    block_on(async {
        let vm = forkd_e2e::boot("python-numpy", 512).await;
        vm.agent.eval("x = 1", None).await.unwrap();
        let e = vm
            .agent
            .eval("import time\ntime.sleep(60)", Some(1000))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("state is lost"), "{e}");
        let r = vm.agent.eval("'x' in globals()", None).await.unwrap();
        assert_eq!(r.result.as_deref(), Some("False"));
        let r = vm.agent.eval("numpy.ones(2).tolist()", None).await.unwrap();
        assert_eq!(
            r.result.as_deref(),
            Some("[1.0, 1.0]"),
            "warm-up imports again after a restart"
        );
        vm.destroy().await;
    });
}
