"""Planted bugs of the offline preference losses: a coefficient flag lost between the command line and the loss
(tests/dpo/test_dpo_formulas.py checks each job's loss calls against OpenRLHF's DPOLoss and KTOLoss)."""
from tests.mutants import Mutant

F = "tests/dpo/test_dpo_formulas.py::"

MUTANTS = [
    Mutant("dpo-beta-fixed", "rlhf/supervised/dpo.py",
           find='''        cfg, beta = self.job.task["dpo"], self.job.task["reference"].beta''',
           replace='''        cfg, beta = self.job.task["dpo"], 0.1''',
           claim="--beta is DPO's beta",
           tests=(F + "test_dpo_flags_reach_the_loss[flags0-want0]",)),
    Mutant("dpo-label-smoothing-ignored", "rlhf/algo/preference_losses.py",
           find='''                    label_smoothing=label_smoothing)''', replace='''                    label_smoothing=0.0)''',
           claim="cDPO's --label_smoothing reaches the loss",
           tests=(F + "test_dpo_flags_reach_the_loss[flags1-want1]",)),
    Mutant("dpo-ipo-is-dpo", "rlhf/algo/preference_losses.py",
           find='''beta=beta, ipo=True)''', replace='''beta=beta, ipo=False)''',
           claim="--ipo is IPO's squared loss",
           tests=(F + "test_dpo_flags_reach_the_loss[flags2-want2]",)),
    Mutant("dpo-kto-weights-ignored", "rlhf/supervised/kto.py",
           find='''desirable_weight=a.desirable_loss_weight,''', replace='''desirable_weight=1.0,''',
           claim="KTO's --desirable_loss_weight reaches the loss",
           tests=(F + "test_kto_flags_reach_the_loss",)),
    Mutant("dpo-kto-beta-fixed", "rlhf/supervised/kto.py",
           find='''        kw = dict(beta=self.job.task["reference"].beta,''', replace='''        kw = dict(beta=0.1,''',
           claim="--beta is KTO's beta",
           tests=(F + "test_kto_flags_reach_the_loss",)),
]
