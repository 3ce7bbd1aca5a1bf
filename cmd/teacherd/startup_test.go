package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"distill/compute"
	"distill/compute/cuda/cudaemu"
	"distill/compute/device"
	"distill/model"
)

// runTeacherd runs `teacherd ARGS --listen 127.0.0.1:0 --metrics off`
// (this test binary) to its end, without CUDA_VISIBLE_DEVICES, and
// returns its stderr and exit status.
func runTeacherd(t *testing.T, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(os.Args[0], append(args, "--listen", "127.0.0.1:0", "--metrics", "off")...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CUDA_VISIBLE_DEVICES=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "TEACHERD_TEST_MAIN=1")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	err := cmd.Run()
	if _, ok := err.(*exec.ExitError); err != nil && !ok {
		t.Fatal(err)
	}
	return stderr.String(), cmd.ProcessState.ExitCode()
}

// lastLine is s's last line.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return lines[len(lines)-1]
}

// TestStartupErrorsOneSentence: teacherd's startup errors read as one
// sentence naming the flag and the fix, without the package prefixes
// each layer wrapped them in: a --devices GPU that does not exist said
// "teacherd: serve: bad configuration: device: unavailable: --devices:
// GPU 1: cuda: device 1 does not exist: the driver sees 1 GPU(s),
// ordinals 0..0". A bad flag value exits 2 (a usage error: it exited 1),
// a GPU or model that fails 1.
func TestStartupErrorsOneSentence(t *testing.T) {
	cudaemu.UseDevices(t, 1, "the GPUs a machine has are its own")
	m := tinyModelDir(t)
	missing := filepath.Join(t.TempDir(), "nosuchmodel")
	weightless := t.TempDir() // config.json alone
	b, err := os.ReadFile(filepath.Join(m, "config.json"))
	if err == nil {
		err = os.WriteFile(filepath.Join(weightless, "config.json"), b, 0o644)
	}
	if err != nil {
		t.Fatal(err)
	}
	// Config files whose values are wrong, on their face and for this
	// model (vocab 64).
	kFile, tlsFile := filepath.Join(weightless, "k.yaml"), filepath.Join(weightless, "tls.yaml")
	for p, yaml := range map[string]string{kFile: "model: " + m + "\nk_max: 100\n", tlsFile: "model: " + m + "\ntls_cert: /x\n"} {
		if err := os.WriteFile(p, []byte(yaml), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		args []string
		code int    // 2: a bad flag value, what the command line alone gets wrong
		want string // the whole line
	}{
		{[]string{"--model", m, "--device", "cuda", "--devices", "0,1"}, 1,
			"teacherd: --devices 0,1: GPU 1 does not exist (this machine has 1 GPU: 0): name only those, or --devices all"},
		{[]string{"--model", m, "--devices", "0,x"}, 2,
			`teacherd: --devices "0,x": want GPU ordinals separated by commas (0,1,2,3) or all`},
		{[]string{"--model", m, "--device", "gpu"}, 2, `teacherd: --device "gpu": want auto, cpu or cuda`},
		{[]string{"--model", m, "--weights", "fp4"}, 2, `teacherd: --weights "fp4": want bf16 or fp8`},
		{[]string{"--model", m, "--k-max", "-3"}, 2,
			"teacherd: --k-max -3: want 1 or more, at most the teacher's vocab size (0 or none: the default, min(vocab size, 4096))"},
		{[]string{"--model", m, "--k-default", "100", "--k-max", "10"}, 2, "teacherd: --k-default 100: want 1 <= k-default <= 10 (--k-max)"},
		{[]string{"--model", m, "--tls-cert", "/x"}, 2, "teacherd: --tls-cert /x: TLS needs --tls-key too (the certificate's private key, PEM), or neither for no TLS"},
		{[]string{"--config", tlsFile}, 1, "teacherd: config " + tlsFile + ": tls_cert: /x: TLS needs tls_key too (the certificate's private key, PEM), or neither for no TLS"},
		// Right on its face, wrong for this model: a failure, as a GPU
		// the machine lacks is, named where it came from.
		{[]string{"--model", m, "--k-max", "100"}, 1, "teacherd: --k-max 100: want 1 <= k-max <= 64 (the teacher's vocab size)"},
		{[]string{"--config", kFile}, 1, "teacherd: config " + kFile + ": k_max: 100: want 1 <= k_max <= 64 (the teacher's vocab size)"},
		{[]string{"--model", missing}, 1, "teacherd: --model " + missing + ": checkpoint directory " + missing +
			" does not exist (give the HF checkpoint's directory: the one holding config.json and model.safetensors)"},
		{[]string{"--model", weightless}, 1, "teacherd: loading teacher: no model.safetensors, model.safetensors.index.json or *.safetensors in " + weightless},
	} {
		stderr, code := runTeacherd(t, tc.args...)
		if got := lastLine(stderr); code != tc.code || got != tc.want {
			t.Errorf("teacherd %s: exit %d, last line\n%s\nwant exit %d and\n%s", strings.Join(tc.args, " "), code, got, tc.code, tc.want)
		}
	}
	// Without a driver: the driver's own fix, then the CPU's.
	t.Setenv("DISTILL_LIBCUDA", filepath.Join(t.TempDir(), "libcuda.so.1"))
	for _, tc := range []struct {
		args         []string
		prefix, tail string
	}{
		{[]string{"--model", m, "--device", "cuda"}, "teacherd: --device cuda: cannot load the CUDA driver: ", "; without a GPU, use --device cpu"},
		{[]string{"--model", m, "--device", "cuda", "--devices", "0"}, "teacherd: --devices 0: GPU 0 does not open: cannot load the CUDA driver: ",
			"; without GPUs, leave --devices out and use --device cpu"},
	} {
		stderr, code := runTeacherd(t, tc.args...)
		got := lastLine(stderr)
		if code != 1 || !strings.HasPrefix(got, tc.prefix) || !strings.HasSuffix(got, tc.tail) || !strings.Contains(got, "DISTILL_LIBCUDA") {
			t.Errorf("teacherd %s without a driver: exit %d, last line\n%s\nwant exit 1, %q ... %q", strings.Join(tc.args, " "), code, got, tc.prefix, tc.tail)
		}
		for _, prefix := range []string{": serve: ", ": device: ", ": cuda: "} {
			if strings.Contains(got, prefix) {
				t.Errorf("teacherd %s: a package prefix %q in %s", strings.Join(tc.args, " "), prefix, got)
			}
		}
	}
}

// TestGPUTooSmall: a GPU too small for the teacher is a startup error
// that says what does not fit, on which GPU, and what to do: for the
// weights, --devices, --weights fp8, a larger GPU and the plan that shows
// the split (`teacherd --plan`); for a token budget, the budget that
// fits. It said "teacherd: serve: invalid request: teacher DIR on cuda:
// infer: does not fit the device memory: ..." (no request was made), and
// a load that ran out of memory named every tensor that failed after the
// first, one line each, each "about 0.0 KiB in BF16".
func TestGPUTooSmall(t *testing.T) {
	cudaemu.UseDevices(t, 1, "shrinks the emulated GPU")
	// What the CUDA backend takes of the device before any weight (its
	// workspace and pool), as the daemon will open it: the use a second
	// backend adds (this process's emulated device holds what other
	// tests left on it too).
	used := func() int64 {
		be, err := device.Open("cuda", device.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { device.Close(be) })
		free, total := be.(compute.DeviceMemory).MemInfo()
		return total - free
	}
	before := used()
	backend := used() - before
	// A teacher of 4 MiB of embedding and as much LM head on a GPU with
	// 1 MiB left after the backend: the embedding does not load.
	dir := t.TempDir()
	cfg, err := model.Preset(model.ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.MaxPositions, cfg.TieEmbeddings = 8192, 256, 1, 256, 256, false
	if err := model.WriteCheckpoint(dir, cfg, model.Init(cfg, model.InitOptions{Seed: 1}), "BF16"); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DISTILL_EMU_DEVICE_MEM", fmt.Sprint(backend+1<<20))
	stderr, code := runTeacherd(t, "--model", dir, "--device", "cuda")
	got := lastLine(stderr)
	for _, want := range []string{
		"teacherd: the teacher " + dir + " does not fit GPU 0 (distill CPU emulator): loading model.embed_tokens.weight ran out of memory (",
		"; it had 1.0 MiB free before its weights, which take about ",
		": spread its layers over several GPUs (--devices 0,1), load its layers' Linear weights in FP8 (--weights fp8: ",
		"or use a GPU with more memory (or --device cpu); `teacherd --plan --model " + dir + " --devices 0,1` (add --weights fp8 for FP8) prints how its layers split over the GPUs and each GPU's bytes",
	} {
		if code != 1 || !strings.Contains(got, want) {
			t.Errorf("weights that do not fit: exit %d, last line\n%s\nwant exit 1 and %q", code, got, want)
		}
	}
	if n := strings.Count(stderr, "ran out of memory"); n != 1 || strings.Contains(got, "invalid request") || strings.Contains(got, "about 0.0 KiB") {
		t.Errorf("weights that do not fit: %d failures said:\n%s", n, stderr)
	}
	// Room for the weights, the reserve and a small forward: a budget of
	// a million tokens does not fit, a smaller one does.
	t.Setenv("DISTILL_EMU_DEVICE_MEM", fmt.Sprint(backend+64<<20+256<<20+16<<20))
	stderr, code = runTeacherd(t, "--model", dir, "--device", "cuda", "--token-budget", "1000000")
	got = lastLine(stderr)
	m := regexp.MustCompile(`^teacherd: the teacher .* does not fit GPU 0 \(distill CPU emulator\): a forward of 1000000 tokens with k up to 4096 and up to 64 draws a position needs .*: lower --token-budget to (\d+) or less \(or lower --k-max or --max-draws, which the check plans for\)$`).FindStringSubmatch(got)
	if code != 1 || m == nil || strings.Contains(got, "invalid request") {
		t.Fatalf("a token budget that does not fit: exit %d, last line\n%s", code, got)
	}
	if n, _ := strconv.Atoi(m[1]); n < 1 || n >= 1000000 {
		t.Errorf("the budget said to fit: %d", n)
	}
}

// TestDeviceFlagsBeforeListening: --device cpu --devices 0,1 is refused
// before the daemon listens (the port below is taken: listening would
// fail otherwise), with no "listening" line before the error; it was
// refused after the daemon had logged that it listened, once the model
// began to load. Flags that exclude each other are a usage error (exit
// 2), as the README's exit statuses and cachectl fill have them; it
// exited 1.
func TestDeviceFlagsBeforeListening(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	cmd := exec.Command(os.Args[0], "--model", tinyModelDir(t), "--device", "cpu", "--devices", "0,1", "--listen", l.Addr().String(), "--metrics", "off")
	cmd.Env = append(os.Environ(), "TEACHERD_TEST_MAIN=1")
	out, _ := cmd.CombinedOutput()
	want := "teacherd: --device cpu --devices 0,1: --devices places the teacher's layers on GPUs: use --device cuda (or auto) with it, or leave --devices out to run on the CPU"
	if code := cmd.ProcessState.ExitCode(); code != 2 || strings.TrimSpace(string(out)) != want {
		t.Errorf("--device cpu --devices 0,1: exit %d, output\n%s\nwant exit 2 and only\n%s", code, out, want)
	}
}
