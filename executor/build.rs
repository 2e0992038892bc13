//! With the `cuda` feature: compiles the CUDA C kernels (`kernels/*.cu`) to CUBIN for the
//! compute capability in `CUDA_COMPUTE_CAP` (default 90: H100, H200) with the toolkit's nvcc,
//! and the cuDNN flash-attention shim (`cudnn/attn.cpp`) with the C++ compiler over the
//! cuDNN and cudnn-frontend headers that `scripts/cuda-toolkit.sh` unpacks. Without the
//! feature it does nothing: the default build needs no CUDA.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "cuda")]
    cuda::build();
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    const HELP: &str =
        "build CUDA shardplan with scripts/build-cuda.sh, which assembles the toolkit and the cuDNN headers";

    fn env(name: &str) -> Option<String> {
        println!("cargo:rerun-if-env-changed={name}");
        std::env::var(name).ok().filter(|v| !v.is_empty())
    }

    fn nvcc() -> PathBuf {
        if let Some(n) = env("NVCC") {
            return n.into();
        }
        if let Some(home) = env("CUDA_HOME").or_else(|| env("CUDA_PATH")) {
            let p = Path::new(&home).join("bin/nvcc");
            if p.exists() {
                return p;
            }
        }
        "nvcc".into()
    }

    fn include_dir(var: &str, header: &str) -> PathBuf {
        let Some(dir) = env(var) else {
            panic!("{var} is not set: it names the folder holding {header}; {HELP}");
        };
        let dir = PathBuf::from(dir);
        if !dir.join(header).exists() {
            panic!("{var}={} holds no {header}; {HELP}", dir.display());
        }
        dir
    }

    pub fn build() {
        let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
        let cap = env("CUDA_COMPUTE_CAP").unwrap_or_else(|| "90".into());
        let cap = cap.trim().replace('.', "");
        let nvcc = nvcc();
        let mut kernels: Vec<PathBuf> = std::fs::read_dir("kernels")
            .expect("executor/kernels holds the CUDA kernels")
            .map(|e| e.expect("listing executor/kernels").path())
            .filter(|p| p.extension().is_some_and(|x| x == "cu" || x == "cuh"))
            .collect();
        kernels.sort();
        for k in &kernels {
            println!("cargo:rerun-if-changed={}", k.display());
        }
        for k in kernels.iter().filter(|p| p.extension().is_some_and(|x| x == "cu")) {
            let stem = k.file_stem().unwrap().to_string_lossy().into_owned();
            let cubin = out.join(format!("{stem}.cubin"));
            let status = Command::new(&nvcc)
                .args(["-cubin", "-O3", "-std=c++17", "-lineinfo"])
                .arg(format!("-arch=sm_{cap}"))
                .arg("-Ikernels")
                .arg("-o")
                .arg(&cubin)
                .arg(k)
                .status()
                .unwrap_or_else(|e| panic!("cannot run nvcc ({}): {e}; {HELP}", nvcc.display()));
            if !status.success() {
                panic!("nvcc failed on {}", k.display());
            }
        }
        println!("cargo:rerun-if-changed=cudnn/attn.cpp");
        let cudnn = include_dir("CUDNN_INCLUDE_DIR", "cudnn.h");
        let frontend = include_dir("CUDNN_FRONTEND_INCLUDE_DIR", "cudnn_frontend.h");
        let cuda_home = env("CUDA_HOME")
            .or_else(|| env("CUDA_PATH"))
            .unwrap_or_else(|| panic!("CUDA_HOME is not set; {HELP}"));
        cc::Build::new()
            .cpp(true)
            .std("c++17")
            .file("cudnn/attn.cpp")
            .define("NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING", None)
            .include(&frontend)
            .include(&cudnn)
            .include(Path::new(&cuda_home).join("include"))
            // The frontend's headers warn by the hundred; the shim's own code is small.
            .warnings(false)
            .compile("shardplan_attn");
        println!("cargo:rustc-link-lib=dl");
    }
}
