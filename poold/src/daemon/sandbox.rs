//! Live sandboxes: a handed-out child VM and its record.

use super::state::SandboxRecord;
use crate::vm::{AgentClient, Vm, VmDir};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

/// One live sandbox. The agent client is cloned out of the VM so requests
/// (exec, eval, files) never wait on the VM lock, which only lifecycle
/// operations (branch, delete) take.
pub struct Sandbox {
    pub id: String,
    pub record: Mutex<SandboxRecord>,
    pub agent: AgentClient,
    pub dir: VmDir,
    pub vm: tokio::sync::Mutex<Option<Vm>>,
}

impl Sandbox {
    pub fn new(vm: Vm, record: SandboxRecord) -> Sandbox {
        Sandbox {
            id: record.id.clone(),
            agent: vm.agent.clone(),
            dir: vm.dir.clone(),
            record: Mutex::new(record),
            vm: tokio::sync::Mutex::new(Some(vm)),
        }
    }

    pub fn record(&self) -> SandboxRecord {
        self.record.lock().unwrap().clone()
    }

    /// Kills QEMU and removes the VM directory. Idempotent.
    pub async fn destroy(&self) {
        if let Some(vm) = self.vm.lock().await.take() {
            vm.destroy().await;
        }
        let _ = std::fs::remove_dir_all(&self.dir.path);
    }
}

/// Every live sandbox by id.
#[derive(Default)]
pub struct Sandboxes {
    map: RwLock<HashMap<String, Arc<Sandbox>>>,
}

impl Sandboxes {
    pub fn get(&self, id: &str) -> Option<Arc<Sandbox>> {
        self.map.read().unwrap().get(id).cloned()
    }

    pub fn insert(&self, sb: Arc<Sandbox>) {
        self.map.write().unwrap().insert(sb.id.clone(), sb);
    }

    pub fn remove(&self, id: &str) -> Option<Arc<Sandbox>> {
        self.map.write().unwrap().remove(id)
    }

    pub fn len(&self) -> usize {
        self.map.read().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All sandboxes, oldest first.
    pub fn all(&self) -> Vec<Arc<Sandbox>> {
        let mut v: Vec<_> = self.map.read().unwrap().values().cloned().collect();
        v.sort_by_key(|s| (s.record.lock().unwrap().created_at_unix, s.id.clone()));
        v
    }
}
