package dist

import (
	"fmt"
	"hash/fnv"
	"net"
	"os"
	"strconv"
	"strings"

	"distill/internal/teacherdial"
)

// The environment variables this package reads besides the launchers'.
const (
	// EnvToken holds the rendezvous token itself.
	EnvToken = "DISTILL_RDZV_TOKEN"
	// EnvTokenFile names a file holding the rendezvous token (kept out
	// of the environment of every process on the node).
	EnvTokenFile = "DISTILL_RDZV_TOKEN_FILE"
	// EnvListenFD is set by Launch for rank 0: the descriptor of a socket
	// already listening at MASTER_ADDR:MASTER_PORT, so that no other
	// process can take the port between the launcher's choice and rank 0.
	EnvListenFD = "DISTILL_RDZV_LISTEN_FD"
	// EnvReportFD is set by Launch for every rank: the descriptor of a
	// pipe on which the rank's group, when it fails, writes the number of
	// the rank it blames, so that Launch names the cause and not the rank
	// whose exit it happened to see first.
	EnvReportFD = "DISTILL_RDZV_REPORT_FD"
)

// Launchers Env.Launcher names.
const (
	LauncherNone     = "none"     // a single process: no launcher variable set
	LauncherTorchrun = "torchrun" // RANK, WORLD_SIZE, ... (torchrun, and Launch)
	LauncherSlurm    = "slurm"    // SLURM_PROCID, SLURM_NTASKS, ... (srun)
)

// slurmPortBase and slurmPortSpan bound the port derived from the Slurm
// job and step ids when MASTER_PORT is not set: below Linux's ephemeral
// range (32768 and up), above the well-known services.
const (
	slurmPortBase = 15000
	slurmPortSpan = 17000
)

// Env is where this process stands in a job: its rank among WorldSize
// processes, its rank on its node, and the rendezvous address.
type Env struct {
	// Launcher says which variables Env came from (LauncherNone, ...).
	Launcher string
	// Rank is this process's rank, 0 to WorldSize-1.
	Rank int
	// WorldSize is the number of processes in the job (1: no rendezvous).
	WorldSize int
	// LocalRank is the rank on this node (the GPU index to use).
	LocalRank int
	// LocalWorldSize is the number of processes on this node, 0 when the
	// launcher does not say (LOCAL_WORLD_SIZE, SLURM_STEP_TASKS_PER_NODE).
	LocalWorldSize int
	// MasterAddr and MasterPort are where rank 0 listens (empty and 0
	// for a world of 1).
	MasterAddr string
	MasterPort int
	// ListenFD is the descriptor of the listening socket a launcher
	// handed rank 0 ($DISTILL_RDZV_LISTEN_FD), 0 when none.
	ListenFD int
	// ReportFD is the descriptor of the launcher's failure report pipe
	// ($DISTILL_RDZV_REPORT_FD), 0 when none.
	ReportFD int
}

// Addr is MasterAddr:MasterPort.
func (e Env) Addr() string { return net.JoinHostPort(e.MasterAddr, strconv.Itoa(e.MasterPort)) }

// String says who this process is, for log lines.
func (e Env) String() string {
	if e.WorldSize <= 1 {
		return "a single process (world size 1)"
	}
	return fmt.Sprintf("rank %d of %d (local rank %d, %s), rendezvous at %s", e.Rank, e.WorldSize, e.LocalRank, e.Launcher, e.Addr())
}

// Discover reads this process's Env from its environment (FromEnv).
func Discover() (Env, error) { return FromEnv(os.Getenv) }

// FromEnv reads an Env through getenv. torchrun's variables (RANK set)
// come first, then Slurm's (SLURM_PROCID set), else the process is a job
// of its own (world size 1). An error names the variable that is missing
// or malformed.
func FromEnv(getenv func(string) string) (Env, error) {
	var e Env
	var err error
	switch {
	case getenv("RANK") != "" || getenv("WORLD_SIZE") != "":
		e, err = torchrunEnv(getenv)
	case getenv("SLURM_PROCID") != "":
		e, err = slurmEnv(getenv)
	default:
		return Env{Launcher: LauncherNone, WorldSize: 1, LocalWorldSize: 1}, nil
	}
	if err != nil {
		return Env{}, err
	}
	if e.Rank == 0 {
		if e.ListenFD, err = fdVar(getenv, EnvListenFD); err != nil {
			return Env{}, err
		}
	}
	if e.ReportFD, err = fdVar(getenv, EnvReportFD); err != nil {
		return Env{}, err
	}
	return e, nil
}

// fdVar reads an inherited descriptor's number, 0 when name is not set.
func fdVar(getenv func(string) string, name string) (int, error) {
	v := getenv(name)
	if v == "" {
		return 0, nil
	}
	fd, err := strconv.Atoi(v)
	if err != nil || fd < 3 {
		return 0, fmt.Errorf("%w: %s=%q: want a file descriptor number of 3 or more", ErrEnv, name, v)
	}
	return fd, nil
}

// rankVars reads a launcher's rank and world size and, for a world of
// more than one, the local rank; by names the launcher for the errors.
func rankVars(getenv func(string) string, launcher, rank, world, local, by string) (Env, error) {
	e := Env{Launcher: launcher}
	var err error
	if e.WorldSize, err = intVar(getenv, world, 1, "set by "+by+" with "+rank); err != nil {
		return Env{}, err
	}
	if e.Rank, err = intVar(getenv, rank, 0, "set by "+by+" with "+world); err != nil {
		return Env{}, err
	}
	if e.Rank >= e.WorldSize {
		return Env{}, fmt.Errorf("%w: %s=%d is not below %s=%d", ErrEnv, rank, e.Rank, world, e.WorldSize)
	}
	if e.WorldSize == 1 {
		e.LocalWorldSize = 1
		return e, nil
	}
	if e.LocalRank, err = intVar(getenv, local, 0, "the process's rank on its node, set by "+by); err != nil {
		return Env{}, err
	}
	return e, nil
}

func torchrunEnv(getenv func(string) string) (Env, error) {
	e, err := rankVars(getenv, LauncherTorchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK", "torchrun")
	if err != nil || e.WorldSize == 1 {
		return e, err
	}
	if getenv("LOCAL_WORLD_SIZE") != "" {
		if e.LocalWorldSize, err = intVar(getenv, "LOCAL_WORLD_SIZE", 1, ""); err != nil {
			return Env{}, err
		}
		if e.LocalRank >= e.LocalWorldSize {
			return Env{}, fmt.Errorf("%w: LOCAL_RANK=%d is not below LOCAL_WORLD_SIZE=%d", ErrEnv, e.LocalRank, e.LocalWorldSize)
		}
	}
	if e.MasterAddr = getenv("MASTER_ADDR"); e.MasterAddr == "" {
		return Env{}, fmt.Errorf("%w: MASTER_ADDR is not set: WORLD_SIZE=%s needs rank 0's address (torchrun sets it)", ErrEnv, getenv("WORLD_SIZE"))
	}
	if e.MasterPort, err = portVar(getenv, "MASTER_PORT"); err != nil {
		return Env{}, err
	}
	return e, nil
}

func slurmEnv(getenv func(string) string) (Env, error) {
	e, err := rankVars(getenv, LauncherSlurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "srun")
	if err != nil || e.WorldSize == 1 {
		return e, err
	}
	for _, name := range []string{"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"} {
		v := getenv(name)
		if v == "" {
			continue
		}
		counts, err := parseTasksPerNode(v)
		if err != nil {
			return Env{}, fmt.Errorf("%w: %s=%q: %v", ErrEnv, name, v, err)
		}
		node, err := intVar(getenv, "SLURM_NODEID", 0, "the node's index in the step, set by srun with "+name)
		if err != nil {
			return Env{}, err
		}
		if node >= len(counts) {
			return Env{}, fmt.Errorf("%w: SLURM_NODEID=%d, but %s=%q counts %d nodes", ErrEnv, node, name, v, len(counts))
		}
		e.LocalWorldSize = counts[node]
		break
	}
	// MASTER_ADDR and MASTER_PORT override what Slurm's variables give.
	if e.MasterAddr = getenv("MASTER_ADDR"); e.MasterAddr == "" {
		name, list := "", ""
		for _, name = range []string{"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"} {
			if list = getenv(name); list != "" {
				break
			}
		}
		if list == "" {
			return Env{}, fmt.Errorf("%w: none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST is set, and no MASTER_ADDR: rank 0's host is unknown (set MASTER_ADDR)", ErrEnv)
		}
		if e.MasterAddr, err = FirstHost(list); err != nil {
			return Env{}, fmt.Errorf("%w: %s: %w", ErrEnv, name, err)
		}
	}
	if getenv("MASTER_PORT") != "" {
		if e.MasterPort, err = portVar(getenv, "MASTER_PORT"); err != nil {
			return Env{}, err
		}
		return e, nil
	}
	job := getenv("SLURM_JOB_ID")
	if _, err := strconv.ParseUint(job, 10, 64); err != nil {
		return Env{}, fmt.Errorf("%w: SLURM_JOB_ID=%q is not a job id, and no MASTER_PORT: the rendezvous port is derived from the job id (set MASTER_PORT)", ErrEnv, job)
	}
	e.MasterPort = SlurmPort(job, getenv("SLURM_STEP_ID"))
	return e, nil
}

// SlurmPort is the rendezvous port of a Slurm job step without
// MASTER_PORT: 15000 + FNV-1a("JOBID.STEPID") mod 17000, the same on every
// node of the step, and most often different for steps that share a node.
func SlurmPort(jobID, stepID string) int {
	h := fnv.New32a()
	h.Write([]byte(jobID + "." + stepID))
	return slurmPortBase + int(h.Sum32()%slurmPortSpan)
}

// intVar reads a decimal integer of at least min from variable name; why
// says what sets it, for the error when it is missing.
func intVar(getenv func(string) string, name string, min int, why string) (int, error) {
	v := getenv(name)
	if v == "" {
		if why != "" {
			why = " (" + why + ")"
		}
		return 0, fmt.Errorf("%w: %s is not set%s", ErrEnv, name, why)
	}
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || n < min {
		return 0, fmt.Errorf("%w: %s=%q: want an integer of at least %d", ErrEnv, name, v, min)
	}
	return n, nil
}

func portVar(getenv func(string) string, name string) (int, error) {
	v := getenv(name)
	if v == "" {
		return 0, fmt.Errorf("%w: %s is not set: rank 0's rendezvous port is needed when the world has more than one process", ErrEnv, name)
	}
	p, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || p < 1 || p > 65535 {
		return 0, fmt.Errorf("%w: %s=%q: want a TCP port, 1 to 65535", ErrEnv, name, v)
	}
	return p, nil
}

// TokenFromEnv reads the rendezvous token from the file $DISTILL_RDZV_TOKEN_FILE
// names (read as teacherd's --token-file is) or from $DISTILL_RDZV_TOKEN;
// "" when neither is set.
func TokenFromEnv(getenv func(string) string) (string, error) {
	file, tok := getenv(EnvTokenFile), getenv(EnvToken)
	switch {
	case file != "" && tok != "":
		return "", fmt.Errorf("%w: both %s and %s are set: give only one", ErrEnv, EnvTokenFile, EnvToken)
	case file != "":
		t, err := teacherdial.ReadToken(file, "$"+EnvTokenFile)
		if err != nil {
			return "", fmt.Errorf("%w: %v", ErrEnv, err) // it names the variable
		}
		return t, nil
	}
	return strings.TrimSpace(tok), nil
}
