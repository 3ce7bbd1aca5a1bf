package dist

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func envOf(kv ...string) func(string) string {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return func(k string) string { return m[k] }
}

func TestFromEnv(t *testing.T) {
	torchrun := []string{"RANK", "5", "WORLD_SIZE", "16", "LOCAL_RANK", "5", "LOCAL_WORLD_SIZE", "8", "MASTER_ADDR", "node01", "MASTER_PORT", "29500"}
	slurm := []string{"SLURM_PROCID", "9", "SLURM_NTASKS", "16", "SLURM_LOCALID", "1", "SLURM_NODEID", "2",
		"SLURM_STEP_TASKS_PER_NODE", "8,4(x2)", "SLURM_JOB_NODELIST", "gpu[07-09,12],login1", "SLURM_STEP_NODELIST", "gpu[08-09,12]",
		"SLURM_JOB_ID", "123456", "SLURM_STEP_ID", "0"}
	cases := []struct {
		name string
		env  []string
		want Env
	}{
		{"none", nil, Env{Launcher: LauncherNone, WorldSize: 1, LocalWorldSize: 1}},
		{"torchrun", torchrun, Env{Launcher: LauncherTorchrun, Rank: 5, WorldSize: 16, LocalRank: 5, LocalWorldSize: 8, MasterAddr: "node01", MasterPort: 29500}},
		{"torchrun, one process", []string{"RANK", "0", "WORLD_SIZE", "1"}, Env{Launcher: LauncherTorchrun, WorldSize: 1, LocalWorldSize: 1}},
		{"torchrun, rank 0 with a listener", append([]string{"RANK", "0", "WORLD_SIZE", "2", "LOCAL_RANK", "0", "MASTER_ADDR", "127.0.0.1", "MASTER_PORT", "4000"}, EnvListenFD, "3"),
			Env{Launcher: LauncherTorchrun, WorldSize: 2, MasterAddr: "127.0.0.1", MasterPort: 4000, ListenFD: 3}},
		{"slurm: the step's first node", slurm, Env{Launcher: LauncherSlurm, Rank: 9, WorldSize: 16, LocalRank: 1, LocalWorldSize: 4, MasterAddr: "gpu08", MasterPort: SlurmPort("123456", "0")}},
		{"slurm: MASTER_ADDR and MASTER_PORT win", append(slurm, "MASTER_ADDR", "10.0.0.1", "MASTER_PORT", "6000"),
			Env{Launcher: LauncherSlurm, Rank: 9, WorldSize: 16, LocalRank: 1, LocalWorldSize: 4, MasterAddr: "10.0.0.1", MasterPort: 6000}},
		{"slurm: the job's node list", []string{"SLURM_PROCID", "0", "SLURM_NTASKS", "2", "SLURM_LOCALID", "0", "SLURM_NODELIST", "a[3-4]", "SLURM_JOB_ID", "7"},
			Env{Launcher: LauncherSlurm, WorldSize: 2, MasterAddr: "a3", MasterPort: SlurmPort("7", "")}},
		{"slurm, one task", []string{"SLURM_PROCID", "0", "SLURM_NTASKS", "1"}, Env{Launcher: LauncherSlurm, WorldSize: 1, LocalWorldSize: 1}},
		{"torchrun over slurm", append(append([]string{}, slurm...), torchrun...), Env{Launcher: LauncherTorchrun, Rank: 5, WorldSize: 16, LocalRank: 5, LocalWorldSize: 8, MasterAddr: "node01", MasterPort: 29500}},
	}
	for _, c := range cases {
		got, err := FromEnv(envOf(c.env...))
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if got != c.want {
			t.Errorf("%s:\n got %+v\nwant %+v", c.name, got, c.want)
		}
	}
}

// TestFromEnvErrors: each malformed or missing variable is named.
func TestFromEnvErrors(t *testing.T) {
	// vars is base without drop and with set.
	vars := func(base map[string]string, drop string, set ...string) []string {
		m := map[string]string{}
		for k, v := range base {
			m[k] = v
		}
		delete(m, drop)
		for i := 0; i+1 < len(set); i += 2 {
			m[set[i]] = set[i+1]
		}
		var kv []string
		for k, v := range m {
			kv = append(kv, k, v)
		}
		return kv
	}
	tr := func(drop string, set ...string) []string {
		return vars(map[string]string{"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}, drop, set...)
	}
	sl := func(drop string, set ...string) []string {
		return vars(map[string]string{"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "42"}, drop, set...)
	}
	cases := []struct {
		env  []string
		want string
	}{
		{tr("WORLD_SIZE"), "WORLD_SIZE is not set"},
		{tr("", "WORLD_SIZE", "four"), `WORLD_SIZE="four"`},
		{tr("", "WORLD_SIZE", "0"), `WORLD_SIZE="0"`},
		{tr("RANK"), "RANK is not set"},
		{tr("", "RANK", "-1"), `RANK="-1"`},
		{tr("", "RANK", "4"), "RANK=4 is not below WORLD_SIZE=4"},
		{tr("LOCAL_RANK"), "LOCAL_RANK is not set"},
		{tr("", "LOCAL_WORLD_SIZE", "1"), "LOCAL_RANK=1 is not below LOCAL_WORLD_SIZE=1"},
		{tr("MASTER_ADDR"), "MASTER_ADDR is not set"},
		{tr("MASTER_PORT"), "MASTER_PORT is not set"},
		{tr("", "MASTER_PORT", "70000"), `MASTER_PORT="70000"`},
		{tr("", "RANK", "0", EnvListenFD, "x"), EnvListenFD},
		{sl("SLURM_NTASKS"), "SLURM_NTASKS is not set"},
		{sl("", "SLURM_PROCID", "x"), `SLURM_PROCID="x"`},
		{sl("", "SLURM_PROCID", "9"), "SLURM_PROCID=9 is not below SLURM_NTASKS=4"},
		{sl("SLURM_LOCALID"), "SLURM_LOCALID is not set"},
		{sl("SLURM_JOB_NODELIST"), "SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST"},
		{sl("", "SLURM_JOB_NODELIST", "n[1-"), "SLURM_JOB_NODELIST"},
		{sl("SLURM_JOB_ID"), "SLURM_JOB_ID"},
		{sl("", "SLURM_TASKS_PER_NODE", "2(x"), "SLURM_TASKS_PER_NODE"},
		{sl("", "SLURM_TASKS_PER_NODE", "2(x2)"), "SLURM_NODEID is not set"},
		{sl("", "SLURM_TASKS_PER_NODE", "2(x2)", "SLURM_NODEID", "2"), "SLURM_NODEID=2"},
		{sl("", "MASTER_PORT", "0"), `MASTER_PORT="0"`},
	}
	for _, c := range cases {
		_, err := FromEnv(envOf(c.env...))
		if err == nil || !errors.Is(err, ErrEnv) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("env %v: got %v, want an ErrEnv naming %q", c.env, err, c.want)
		}
	}
}

func TestSlurmPort(t *testing.T) {
	p := SlurmPort("123456", "0")
	if p < slurmPortBase || p >= slurmPortBase+slurmPortSpan {
		t.Fatalf("port %d outside [%d, %d)", p, slurmPortBase, slurmPortBase+slurmPortSpan)
	}
	if p != SlurmPort("123456", "0") {
		t.Fatal("not deterministic")
	}
	if p == SlurmPort("123456", "1") && p == SlurmPort("123457", "0") {
		t.Fatalf("port %d ignores the step and the job", p)
	}
}

func TestNodelist(t *testing.T) {
	cases := []struct {
		list  string
		first string
		all   []string
	}{
		{"node[01-04,07],gpu5", "node01", []string{"node01", "node02", "node03", "node04", "node07", "gpu5"}},
		{"gpu5", "gpu5", []string{"gpu5"}},
		{"a,b,c", "a", []string{"a", "b", "c"}},
		{"n[9-11]", "n9", []string{"n9", "n10", "n11"}},
		{"n[098-101]x", "n098x", []string{"n098x", "n099x", "n100x", "n101x"}},
		{"r[1-2]n[3,5]", "r1n3", []string{"r1n3", "r1n5", "r2n3", "r2n5"}},
		{"[3-4]", "3", []string{"3", "4"}},
		{"login1,cn[7]", "login1", []string{"login1", "cn7"}},
		{"host-1.example.org", "host-1.example.org", []string{"host-1.example.org"}},
	}
	for _, c := range cases {
		first, err := FirstHost(c.list)
		if err != nil || first != c.first {
			t.Errorf("FirstHost(%q) = %q, %v; want %q", c.list, first, err, c.first)
		}
		all, err := ExpandNodelist(c.list)
		if err != nil || !reflect.DeepEqual(all, c.all) {
			t.Errorf("ExpandNodelist(%q) = %q, %v; want %q", c.list, all, err, c.all)
		}
	}
	for _, bad := range []string{"", "n[1-", "n]", "n[]", "n[a-b]", "n[4-2]", "n[1-2-3]", ",n1", "n1,", "n[[1]]", "n 1", "n[0-99999999]", "n[0-300]m[0-300]"} {
		if _, err := ExpandNodelist(bad); err == nil {
			t.Errorf("ExpandNodelist(%q): no error", bad)
		}
	}
	for _, bad := range []string{"", "n[1-", "n[4-2]", ",n1"} {
		if _, err := FirstHost(bad); err == nil {
			t.Errorf("FirstHost(%q): no error", bad)
		}
	}
}

func TestTasksPerNode(t *testing.T) {
	got, err := parseTasksPerNode("2(x3),1,4")
	if want := []int{2, 2, 2, 1, 4}; err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, %v; want %v", got, err, want)
	}
	for _, bad := range []string{"", "x", "2(3)", "2(x0)", "0", "2(x2", "2(y2)"} {
		if _, err := parseTasksPerNode(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

func TestTokenFromEnv(t *testing.T) {
	f := filepath.Join(t.TempDir(), "token")
	os.WriteFile(f, []byte("  s3cret\n"), 0o600)
	if tok, err := TokenFromEnv(envOf(EnvTokenFile, f)); err != nil || tok != "s3cret" {
		t.Errorf("file: %q, %v", tok, err)
	}
	if tok, err := TokenFromEnv(envOf(EnvToken, "abc")); err != nil || tok != "abc" {
		t.Errorf("env: %q, %v", tok, err)
	}
	if tok, err := TokenFromEnv(envOf()); err != nil || tok != "" {
		t.Errorf("none: %q, %v", tok, err)
	}
	if _, err := TokenFromEnv(envOf(EnvToken, "abc", EnvTokenFile, f)); err == nil || !strings.Contains(err.Error(), "only one") {
		t.Errorf("both: %v", err)
	}
	empty := filepath.Join(t.TempDir(), "empty")
	os.WriteFile(empty, nil, 0o600)
	for _, p := range []string{empty, filepath.Join(t.TempDir(), "missing")} {
		if _, err := TokenFromEnv(envOf(EnvTokenFile, p)); err == nil || !strings.Contains(err.Error(), EnvTokenFile) {
			t.Errorf("%s: %v", p, err)
		}
	}
}

func TestFlattenConfig(t *testing.T) {
	type inner struct {
		LR    float64  `yaml:"lr"`
		Dirs  []string `yaml:"dirs"`
		Empty []int    `yaml:"empty"`
	}
	got, err := FlattenConfig(struct {
		RunDir string            `yaml:"run_dir"`
		Optim  inner             `yaml:"optim"`
		Map    map[string]string `yaml:"map"`
		Ptr    *inner            `yaml:"ptr"`
	}{RunDir: "r", Optim: inner{LR: 3e-4, Dirs: []string{"a", "b"}}, Map: map[string]string{}})
	want := map[string]string{"run_dir": "r", "optim.lr": "0.0003", "optim.dirs[0]": "a", "optim.dirs[1]": "b", "optim.empty": "[]", "map": "{}", "ptr": "null"}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, %v\nwant %v", got, err, want)
	}
}
