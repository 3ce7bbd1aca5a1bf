package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/internal/cli"
)

// fakeRoot writes files (path under root: content) into a new directory
// standing for /: /proc and /sys/fs/cgroup as a test machine has them.
func fakeRoot(t *testing.T, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for p, c := range files {
		f := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

const (
	gib         = 1 << 30
	meminfo64   = "MemTotal:       67108864 kB\nMemFree:        1000 kB\nMemAvailable:   67108864 kB\n" // 64 GiB available
	v2SlurmProc = "0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n"
	v2Job       = "sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/"
)

// TestAvailableMemory: the memory init may take is the smaller of the
// machine's MemAvailable and the room under the memory limits of the
// process's cgroup and its ancestors (limit less use, the inactive file
// cache not counted as use), cgroup v2 or v1; "max" and v1's
// page-counter maximum are no limit; the bound is named.
func TestAvailableMemory(t *testing.T) {
	for _, c := range []struct {
		name  string
		files map[string]string
		bytes int64
		bound string // the limit's file that bounds it; "": MemAvailable
	}{
		{"machine only", map[string]string{"proc/meminfo": meminfo64}, 64 * gib, ""},
		{"v2 job limit above the task's", map[string]string{
			"proc/meminfo": meminfo64, "proc/self/cgroup": v2SlurmProc,
			v2Job + "memory.max": "2147483648\n", v2Job + "memory.current": "1610612736\n", v2Job + "memory.stat": "anon 100\ninactive_file 536870912\nactive_file 5\n",
			v2Job + "step_0/user/task_0/memory.max": "max\n", v2Job + "step_0/user/task_0/memory.current": "1000\n",
		}, 1 * gib, "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/memory.max"},
		{"v2 the tighter of two levels", map[string]string{
			"proc/meminfo": meminfo64, "proc/self/cgroup": v2SlurmProc,
			v2Job + "memory.max": "8589934592\n", v2Job + "memory.current": "0\n",
			v2Job + "step_0/memory.max": "3221225472\n", v2Job + "step_0/memory.current": "1073741824\n",
		}, 2 * gib, "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/step_0/memory.max"},
		{"v2 no limit", map[string]string{
			"proc/meminfo": meminfo64, "proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": "max\n", "sys/fs/cgroup/memory.current": "1\n",
		}, 64 * gib, ""},
		{"v2 limit above MemAvailable", map[string]string{
			"proc/meminfo": "MemAvailable:   1048576 kB\n", "proc/self/cgroup": "0::/c\n", "sys/fs/cgroup/c/memory.max": "4294967296\n", "sys/fs/cgroup/c/memory.current": "0\n",
		}, 1 * gib, ""},
		{"v2 container sees its cgroup as the root", map[string]string{
			"proc/meminfo": meminfo64, "proc/self/cgroup": "0::/docker/abc\n", "sys/fs/cgroup/memory.max": "1073741824\n", "sys/fs/cgroup/memory.current": "268435456\n",
		}, 768 << 20, "/sys/fs/cgroup/memory.max"},
		{"v1", map[string]string{
			"proc/meminfo": meminfo64, "proc/self/cgroup": "5:devices:/\n4:memory:/process_api/x\n0::/\n",
			"sys/fs/cgroup/memory/memory.limit_in_bytes":               "9223372036854771712\n",
			"sys/fs/cgroup/memory/process_api/x/memory.limit_in_bytes": "2147483648\n", "sys/fs/cgroup/memory/process_api/x/memory.usage_in_bytes": "1073741824\n",
			"sys/fs/cgroup/memory/process_api/x/memory.stat": "inactive_file 1\ntotal_inactive_file 536870912\n",
		}, 1536 << 20, "/sys/fs/cgroup/memory/process_api/x/memory.limit_in_bytes"},
		{"v1 no limit", map[string]string{
			"proc/meminfo": meminfo64, "proc/self/cgroup": "4:memory:/x\n", "sys/fs/cgroup/memory/x/memory.limit_in_bytes": "9223372036854771712\n",
			"sys/fs/cgroup/memory/x/memory.usage_in_bytes": "5\n",
		}, 64 * gib, ""},
		{"a limit without meminfo", map[string]string{
			"proc/self/cgroup": "0::/c\n", "sys/fs/cgroup/c/memory.max": "1073741824\n", "sys/fs/cgroup/c/memory.current": "1073741825\n",
		}, 0, "/sys/fs/cgroup/c/memory.max"},
	} {
		m, ok := availableMemory(fakeRoot(t, c.files))
		if !ok || m.bytes != c.bytes || filepath.Join(m.cgroup, m.limitFile) != c.bound && !(c.bound == "" && m.cgroup == "") {
			t.Errorf("%s: %+v (ok %v), want %d bytes bounded by %q", c.name, m, ok, c.bytes, c.bound)
		}
	}
	if m, ok := availableMemory(t.TempDir()); ok {
		t.Errorf("nothing to read: %+v, want ok false", m)
	}
}

// TestInitRefusesOverCgroupLimit: on a machine with 64 GiB available, a
// process limited to 96 MiB by its cgroup (a container, a Slurm job), 32
// MiB of it in use, is refused an init that needs more than the 64 MiB
// left, naming the cgroup's limit; init read only MemAvailable, and went
// on to be killed by the OOM killer.
func TestInitRefusesOverCgroupLimit(t *testing.T) {
	root := fakeRoot(t, map[string]string{
		"proc/meminfo": meminfo64, "proc/self/cgroup": v2SlurmProc,
		v2Job + "memory.max": "100663296\n", v2Job + "memory.current": "33554432\n",
	})
	mem, disk := hostMemAvailable, diskFree
	t.Cleanup(func() { hostMemAvailable, diskFree = mem, disk })
	hostMemAvailable = func() (memAvail, bool) { return availableMemory(root) }
	diskFree = func(string) (int64, bool) { return 0, false }
	out := filepath.Join(t.TempDir(), "m")
	err := runInit([]string{"--out", out, "--vocab", "100000", "--hidden", "64"})
	want := "initializing it takes 85.8 MiB of memory, and this process may use 64.0 MiB (the memory limit of its cgroup: 96.0 MiB in /sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/memory.max, 32.0 MiB of it in use; the machine has 64.0 GiB available): check the size flags"
	if err == nil || cli.ExitStatus(err) != 1 || !strings.Contains(err.Error(), want) {
		t.Errorf("init of 86 MiB under a 96 MiB cgroup limit, 32 MiB in use: %v\nwant %q", err, want)
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Errorf("a refused init made %s", out)
	}
}
